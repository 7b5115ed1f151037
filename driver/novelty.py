"""Is a teacher's program new work, or a copy of what its prompt showed it?

A proposal's program is a *copy* when its structure (what `f` executes: `f` and the
functions it calls, bound names and constants abstracted, `verifier_sandbox.structure_hash`;
top-level prints and helpers `f` never calls do not count) equals that of a seed program
(`driver.seeds`) or of a reference task shown in its own prompt. Self-play rewards whatever is valid and unsolved; a copy of a
reference is always valid and often unsolved, so without this rule the policy gradient
teaches teachers to copy (see docs/learning.md, "Copies and novel work").

Two rules are measured:

- `copy_of` (the one `tasks.reject_copies` acts on): equal structure. Renaming a variable
  or changing a constant is free for a language model and leaves the task's structure
  (what a student must trace) as it was, so these count as copies.
- `exact_copy`: equal source after `ast.unparse(ast.parse(...))` (layout and comments
  ignored, names and constants kept), the stricter rule; recorded beside it so that the
  two can be compared in `tasks.parquet`.

Only code_i / code_o proposals write a program; a code_f task runs a program from the
buffer by design and is never a copy.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from functools import lru_cache

from driver.records import SEED_TEACHER, Task
from driver.seeds import SEED_PROGRAMS
from verifier_sandbox import ast_hash, structure_hash

WRITES_PROGRAM = ("code_i", "code_o")


@lru_cache(maxsize=4096)
def _hash(program: str) -> str | None:
    """The structure of what `f` executes; a program without one `f` by its whole AST."""
    return structure_hash(program) or ast_hash(program)


@lru_cache(maxsize=4096)
def _unparsed(program: str) -> str | None:
    try:
        return ast.unparse(ast.parse(program))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


@lru_cache(maxsize=1)
def _seed_index() -> tuple[dict[str, str], dict[str, str]]:
    """ast_hash -> "seed N" and unparsed source -> "seed N" (N counts from 1, the order of
    `driver.seeds.SEED_PROGRAMS`)."""
    hashes: dict[str, str] = {}
    sources: dict[str, str] = {}
    for i, seed in enumerate(SEED_PROGRAMS, 1):
        h, u = _hash(seed.program), _unparsed(seed.program)
        if h is not None:
            hashes.setdefault(h, f"seed {i}")
        if u is not None:
            sources.setdefault(u, f"seed {i}")
    return hashes, sources


def _reference_name(ref: Task, position: int) -> str:
    """A shown reference, named by where it came from: a seed's number, or its teacher and step."""
    hashes, _ = _seed_index()
    if ref.teacher == SEED_TEACHER:
        return hashes.get(_hash(ref.program) or "", f"reference {position}")
    return f"reference {position} ({ref.teacher}, step {ref.step})"


def copy_of(task_type: str, program: str | None, references: Sequence[Task]) -> str | None:
    """What the program copies under the ast_hash rule ("seed 3", "reference 1 (t0, step 4)"),
    or None when it is new (or does not parse, or its task type does not write a program)."""
    if task_type not in WRITES_PROGRAM or not program:
        return None
    h = _hash(program)
    if h is None:
        return None
    for i, ref in enumerate(references, 1):
        if _hash(ref.program) == h:
            return _reference_name(ref, i)
    return _seed_index()[0].get(h)


def exact_copy(task_type: str, program: str | None, references: Sequence[Task]) -> bool:
    """The stricter rule: the same source as a seed or a shown reference after
    `ast.unparse(ast.parse(...))`."""
    if task_type not in WRITES_PROGRAM or not program:
        return False
    u = _unparsed(program)
    if u is None:
        return False
    return u in _seed_index()[1] or any(_unparsed(ref.program) == u for ref in references)
