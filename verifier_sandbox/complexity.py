"""Static complexity measures of a program, logged per proposal to watch task difficulty."""

from __future__ import annotations

import ast

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
