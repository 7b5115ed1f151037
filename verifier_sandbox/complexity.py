"""Static measures of a program, logged per proposal: complexity (task difficulty) and an
AST hash (which programs are new, for the population's coverage)."""

from __future__ import annotations

import ast
import hashlib

from .screening import parse

KEYS = ("ast_depth", "cyclomatic", "loc", "n_variables", "n_nodes")

# Nodes that add one independent path (McCabe): branches, loops, handlers, conditions.
_DECISIONS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler,
              ast.comprehension, ast.Assert, ast.match_case)


def _depth(node: ast.AST) -> int:
    # Iterative so that deeply nested (hostile) programs cannot overflow the C stack.
    best, stack = 0, [(node, 1)]
    while stack:
        current, depth = stack.pop()
        best = max(best, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(current))
    return best


def complexity(program: str) -> dict[str, int]:
    """Returns ast_depth, cyclomatic, loc, n_variables and n_nodes (all 0 if unparsable).

    cyclomatic = 1 + #decision points, where a decision point is a branch, loop,
    comprehension clause, handler, assert or case, and each extra operand of and/or.
    """
    tree = parse(program) if isinstance(program, str) else None
    if tree is None:
        return dict.fromkeys(KEYS, 0)
    nodes = list(ast.walk(tree))
    decisions = sum(isinstance(n, _DECISIONS) for n in nodes)
    decisions += sum(len(n.values) - 1 for n in nodes if isinstance(n, ast.BoolOp))
    decisions += sum(len(n.ifs) for n in nodes if isinstance(n, ast.comprehension))
    names = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names |= {n.arg for n in nodes if isinstance(n, ast.arg)}
    loc = sum(1 for line in program.splitlines()
              if line.strip() and not line.strip().startswith("#"))
    return {
        "ast_depth": _depth(tree),
        "cyclomatic": 1 + decisions,
        "loc": loc,
        "n_variables": len(names),
        "n_nodes": len(nodes),
    }


# Fields whose string value names something: abstracted when the program itself binds the name.
_IDENTIFIER_FIELDS = {"id", "arg", "name", "asname", "names", "rest", "attr"}


def _bound_names(nodes: list[ast.AST]) -> set[str]:
    """Names the program binds: assigned variables, parameters, def/class names, aliases, handlers."""
    bound: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            bound.add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.alias) and n.asname:
            bound.add(n.asname)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            bound.update(n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
            bound.add(n.name)
        elif isinstance(n, ast.MatchMapping) and n.rest:
            bound.add(n.rest)
    return bound


def ast_hash(program: str) -> str | None:
    """A 16-hex-digit hash of the program's AST with names and constants abstracted; None if
    the program does not parse.

    Two programs get the same hash when they differ only in the names they bind (variables,
    parameters, functions, classes: renamed to v0, v1, ... in order of first appearance, so
    the data flow between them still counts), in the values of their constants (each
    replaced by its type: `x + 1` and `y + 7` agree, `x + 1` and `x + 'a'` do not), in
    comments or in layout. Names the program does not bind (builtins such as `sorted`,
    modules, attributes such as `.append`) are operations and are kept. Iterative, so a
    deeply nested (hostile) program cannot overflow the stack.
    """
    tree = parse(program) if isinstance(program, str) else None
    if tree is None:
        return None
    bound = _bound_names(list(ast.walk(tree)))
    canonical: dict[str, str] = {}

    def name(value: str) -> str:
        if value not in bound:
            return value
        return canonical.setdefault(value, f"v{len(canonical)}")

    tokens: list[str] = []
    stack: list[object] = [tree]
    while stack:  # pre-order, left to right: children are pushed in reverse
        node = stack.pop()
        if isinstance(node, str):
            tokens.append(node)
            continue
        if not isinstance(node, ast.AST):
            tokens.append(repr(node))
            continue
        tokens.append(type(node).__name__)
        if isinstance(node, ast.Constant):
            tokens.append(type(node.value).__name__)
            continue
        children: list[object] = []
        for field, value in ast.iter_fields(node):
            if field == "type_comment" or field == "kind":
                continue
            children.append(f".{field}")
            if isinstance(value, list):
                children.append(f"[{len(value)}")
                for item in value:
                    children.append(name(item) if isinstance(item, str) and field in _IDENTIFIER_FIELDS else item)
            elif isinstance(value, str) and field in _IDENTIFIER_FIELDS:
                children.append(f"={name(value)}")
            elif isinstance(value, ast.AST):
                children.append(value)
            else:
                children.append(f"={value!r}")
        stack.extend(reversed(children))
    return hashlib.sha1("\x00".join(tokens).encode()).hexdigest()[:16]
