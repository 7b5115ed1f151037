"""What `f` executes: a program's structure, its dead code, and whether `f` reads its input.

A teacher can make a repeated task look new by appending code that `f` never runs (a
top-level `print(f(1))`, a helper `f` never calls). A task's *structure* is therefore taken
from what `f` executes: `f` and the top-level functions and classes it refers to,
transitively, with names and constants abstracted (`complexity.ast_hash`); top-level
statements, functions `f` never reaches and comments do not count.

Static only: nothing here runs the program.
"""

from __future__ import annotations

import ast

from .complexity import ast_hash
from .screening import parse

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _function_f(tree: ast.Module) -> ast.FunctionDef | None:
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "f"]
    return defs[0] if len(defs) == 1 and isinstance(defs[0], ast.FunctionDef) else None


def _names_read(nodes: list[ast.AST]) -> set[str]:
    return {n.id for root in nodes for n in ast.walk(root) if isinstance(n, ast.Name)}


def _reachable(tree: ast.Module, roots: list[ast.AST]) -> set[str]:
    """Names of the top-level functions and classes that `roots` refer to, transitively."""
    defs = {n.name: n for n in tree.body if isinstance(n, _DEFS)}
    seen: set[str] = set()
    frontier = _names_read(roots) & defs.keys()
    while frontier:
        name = frontier.pop()
        seen.add(name)
        frontier |= (_names_read([defs[name]]) & defs.keys()) - seen
    return seen


def executed_defs(program: str) -> list[ast.stmt] | None:
    """`f` and the top-level functions and classes it reaches, in source order; None when the
    program does not parse or has no single `def f`."""
    tree = parse(program) if isinstance(program, str) else None
    f = _function_f(tree) if tree is not None else None
    if f is None:
        return None
    reached = _reachable(tree, [f]) | {"f"}
    return [n for n in tree.body if isinstance(n, _DEFS) and n.name in reached]


def structure_hash(program: str) -> str | None:
    """The `ast_hash` of what `f` executes (see the module docstring); None without a single
    `def f`. Padding a program with top-level calls or unused helpers leaves it unchanged."""
    defs = executed_defs(program)
    if defs is None:
        return None
    return ast_hash(ast.unparse(ast.Module(body=defs, type_ignores=[])))


def structure_nodes(program: str) -> int | None:
    """AST nodes of what `f` executes: the size of the task's work, padding excluded."""
    defs = executed_defs(program)
    if defs is None:
        return None
    return sum(1 for d in defs for _ in ast.walk(d))


def _is_main_guard(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _only_expressions(body: list[ast.stmt]) -> bool:
    """A block that binds nothing the rest of the program could read: expression statements
    (and `pass`) only, nested loops and branches of the same."""
    for node in body:
        if isinstance(node, (ast.Expr, ast.Pass)):
            continue
        if isinstance(node, (ast.For, ast.While, ast.If)) and _only_expressions(node.body) and _only_expressions(
                node.orelse):
            continue
        return False
    return True


def _dead_statement(node: ast.stmt) -> bool:
    """A top-level statement that only shows or exercises `f`: an expression statement
    (`print(f(3))`, a docstring), an `if __name__ == "__main__":` block, or a loop or branch
    whose body is nothing but expression statements."""
    if isinstance(node, ast.Expr) or _is_main_guard(node):
        return True
    if isinstance(node, (ast.For, ast.While, ast.If)):
        return _only_expressions(node.body) and _only_expressions(node.orelse)
    return False


def strip_dead_code(program: str) -> str:
    """The program without what `f` never executes: dead top-level statements
    (`_dead_statement`) and the top-level functions and classes that neither `f` nor the kept
    statements reach. Kept lines keep their text and comments. Returns the program unchanged
    when it does not parse, has no single `def f`, or nothing is dead."""
    tree = parse(program) if isinstance(program, str) else None
    f = _function_f(tree) if tree is not None else None
    if f is None:
        return program
    kept_statements = [n for n in tree.body if not isinstance(n, _DEFS) and not _dead_statement(n)]
    reached = _reachable(tree, [f, *kept_statements]) | {"f"}
    drop = [n for n in tree.body if (n not in kept_statements and not isinstance(n, _DEFS))
            or (isinstance(n, _DEFS) and n.name not in reached)]
    if not drop:
        return program
    lines = program.splitlines(keepends=True)
    spans = [(min([n.lineno, *(d.lineno for d in getattr(n, "decorator_list", []))]), n.end_lineno)
             for n in tree.body]
    # statements sharing a line (`x = 1; print(x)`) cannot be cut by lines: rebuild from the tree
    if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
        return ast.unparse(ast.Module(body=[n for n in tree.body if n not in drop], type_ignores=[])) + "\n"
    cut = set()
    for node, (start, end) in zip(tree.body, spans):
        if node in drop:
            cut.update(range(start - 1, end))
    stripped = "".join(line for i, line in enumerate(lines) if i not in cut)
    return stripped.rstrip() + "\n"


def reads_parameters(program: str) -> bool | None:
    """Whether `f` reads any of its parameters anywhere in its body (nested functions
    included); None without a single `def f`. A function that reads none is input-blind:
    every input gives the same output."""
    tree = parse(program) if isinstance(program, str) else None
    f = _function_f(tree) if tree is not None else None
    if f is None:
        return None
    a = f.args
    params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]}
    read = {n.id for stmt in f.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return bool(params & read)
