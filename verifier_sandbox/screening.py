"""Static screening of untrusted programs: a first, cheap filter before isolated execution.

Screening is not the security boundary (the sandbox is); it rejects programs that are
obviously trying to reach the host, so teachers learn that such tasks are invalid and the
sandbox rarely has to contain them.
"""

from __future__ import annotations

import ast
import threading

# CPython (3.11 here) keeps the AST constructor's recursion counter per interpreter, not per
# thread: when a thread switch lands inside one thread's AST construction (a garbage
# collection running a finalizer, say) and another thread parses meanwhile, the first fails
# with "SystemError: AST constructor recursion depth mismatch". Callers run in thread pools
# (eval loading and scoring, the CLI), so every AST this project builds from text goes
# through `parse` or `literal` below, under this lock.
AST_LOCK = threading.RLock()

ALLOWED_MODULES = frozenset({
    "math", "itertools", "functools", "collections", "heapq", "bisect", "string", "re",
    "operator", "statistics", "fractions", "decimal", "typing", "dataclasses", "copy",
})

# One table: what is banned and why. Modules not listed here and not allowed above are
# rejected as "not allowed" (an allow-list, so new stdlib modules are banned by default).
BANNED_MODULES: dict[str, str] = {
    "os": "operating system access",
    "sys": "interpreter internals",
    "subprocess": "spawns processes",
    "socket": "network access",
    "ssl": "network access",
    "urllib": "network access",
    "http": "network access",
    "ctypes": "raw memory and C calls",
    "cffi": "raw memory and C calls",
    "multiprocessing": "spawns processes",
    "concurrent": "spawns processes or threads",
    "threading": "threads escape the time limit",
    "_thread": "threads escape the time limit",
    "signal": "signal handling",
    "random": "non-deterministic",
    "secrets": "non-deterministic",
    "uuid": "non-deterministic",
    "time": "clock access (non-deterministic)",
    "datetime": "clock access (non-deterministic)",
    "shutil": "file system access",
    "pathlib": "file system access",
    "tempfile": "file system access",
    "glob": "file system access",
    "io": "file access",
    "importlib": "dynamic imports",
    "builtins": "escape hatch to banned builtins",
    "inspect": "frame and code introspection",
    "gc": "reaches every live object",
    "pickle": "arbitrary code on load",
    "marshal": "arbitrary code objects",
    "resource": "changes process limits",
    "pty": "spawns terminals",
    "asyncio": "event loops, processes and sockets",
    "code": "interactive interpreter",
    "codeop": "compiles code",
    "runpy": "runs modules",
    "sysconfig": "host paths",
    "platform": "host introspection",
    "mmap": "raw memory",
    "fcntl": "file descriptor control",
    "select": "file descriptor polling",
    "weakref": "object graph access",
    "traceback": "frame access",
    "types": "constructs code and function objects",
}

BANNED_NAMES: dict[str, str] = {
    "__import__": "dynamic import",
    "eval": "evaluates text as code",
    "exec": "executes text as code",
    "compile": "builds code objects",
    "open": "file access",
    "globals": "namespace access",
    "locals": "namespace access",
    "vars": "namespace access",
    "getattr": "reflective attribute access",
    "setattr": "reflective attribute access",
    "delattr": "reflective attribute access",
    "breakpoint": "debugger",
    "input": "reads stdin",
    "exit": "exits the interpreter",
    "quit": "exits the interpreter",
    "memoryview": "raw memory",
    "help": "interactive help",
}

# Dunders that reach no interpreter internals; `super().__init__()` and
# `if __name__ == "__main__":` are common in honest programs.
HARMLESS_DUNDERS = frozenset({"__init__", "__name__"})


def _module_reason(module: str) -> str | None:
    top = module.split(".")[0]
    if top in ALLOWED_MODULES:
        return None
    why = BANNED_MODULES.get(top, "not in the allowed modules")
    return f"forbidden: import {top} ({why})"


def _node_reason(node: ast.AST) -> str | None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            reason = _module_reason(alias.name)
            if reason:
                return reason
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            return "forbidden: relative import"
        return _module_reason(node.module or "")
    elif isinstance(node, ast.Name) and node.id in BANNED_NAMES:
        return f"forbidden: {node.id} ({BANNED_NAMES[node.id]})"
    elif isinstance(node, ast.Attribute):
        # Dunder attributes are the classic sandbox escape (__subclasses__, __globals__, ...).
        if (node.attr.startswith("__") and node.attr.endswith("__")
                and node.attr not in HARMLESS_DUNDERS):
            return f"forbidden: attribute {node.attr}"
        if node.attr in BANNED_NAMES:
            return f"forbidden: attribute {node.attr} ({BANNED_NAMES[node.attr]})"
    elif isinstance(node, (ast.Name, ast.arg)):
        name = node.id if isinstance(node, ast.Name) else node.arg
        if name.startswith("__") and name.endswith("__") and name not in HARMLESS_DUNDERS:
            return f"forbidden: name {name}"
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        # A dunder string is how getattr-style escapes smuggle names past the checks above.
        if "__" in node.value and any(
            part in node.value for part in ("__class__", "__subclasses__", "__globals__",
                                            "__builtins__", "__code__", "__import__")):
            return "forbidden: dunder name in a string"
    return None


def screen_tree(tree: ast.AST) -> str | None:
    """Screens a parsed tree; returns None if it passes, else the reason."""
    for node in ast.walk(tree):
        reason = _node_reason(node)
        if reason:
            return reason
    return None


def parse(program: str, mode: str = "exec") -> ast.AST | None:
    """Parses source safely (no execution); None if it is not valid Python."""
    try:
        with AST_LOCK:
            return ast.parse(program, mode=mode)
    except (SyntaxError, ValueError, RecursionError, MemoryError, TypeError):
        return None


def literal(text: str) -> object:
    """`ast.literal_eval` of text, under the AST lock; raises as literal_eval does."""
    with AST_LOCK:
        return ast.literal_eval(text)


def screen(program: str) -> str | None:
    """Statically screens a program; None means it passes, otherwise a short reason."""
    if not isinstance(program, str):
        return "syntax error"
    tree = parse(program)
    if tree is None:
        return "syntax error"
    try:
        return screen_tree(tree)
    except RecursionError:
        return "syntax error"
