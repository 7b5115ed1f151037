"""Checks for the seed programs in driver/seeds.py.

The seeds are our own trusted code, so executing them with exec() here is fine.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from driver.seeds import SEED_PROGRAMS, SeedProgram  # noqa: E402

ALLOWED_MODULES = {
    "math",
    "itertools",
    "functools",
    "collections",
    "heapq",
    "bisect",
    "string",
    "re",
    "operator",
}
FORBIDDEN_NAMES = {
    "print",
    "open",
    "input",
    "eval",
    "exec",
    "compile",
    "__import__",
    "globals",
    "locals",
    "vars",
    "setattr",
    "delattr",
    "breakpoint",
    "exit",
    "quit",
    "hash",
    "id",
}
MAX_SECONDS_PER_CALL = 0.5

IDS = [f"seed{i:02d}" for i in range(len(SEED_PROGRAMS))]


def _literal_args(input_text: str) -> list:
    """Parse ``f(<input_text>)`` and return the argument values, literal-only."""
    tree = ast.parse("f(" + input_text + ")", mode="eval")
    call = tree.body
    assert isinstance(call, ast.Call)
    assert isinstance(call.func, ast.Name) and call.func.id == "f"
    assert not call.keywords, f"keyword arguments not allowed: {input_text!r}"
    values = []
    for arg in call.args:
        assert not isinstance(arg, ast.Starred), f"starred argument: {input_text!r}"
        values.append(ast.literal_eval(ast.unparse(arg)))
    return values


def _run(program: str, input_text: str):
    namespace: dict = {"__name__": "seed_program"}
    exec(compile(program, "<seed>", "exec"), namespace)
    f = namespace["f"]
    args = _literal_args(input_text)
    start = time.perf_counter()
    result = f(*args)
    elapsed = time.perf_counter() - start
    assert elapsed < MAX_SECONDS_PER_CALL, f"call took {elapsed:.3f}s on {input_text!r}"
    return result


def _is_plain_literal(value) -> bool:
    """Only ints, finite floats, strings, bools, None, lists, tuples, dicts."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_plain_literal(v) for v in value)
    if isinstance(value, dict):
        return all(_is_plain_literal(k) and _is_plain_literal(v) for k, v in value.items())
    return False


def test_at_least_40_seeds():
    assert len(SEED_PROGRAMS) >= 40
    assert all(isinstance(s, SeedProgram) for s in SEED_PROGRAMS)


def test_programs_distinct():
    programs = [s.program for s in SEED_PROGRAMS]
    assert len(set(programs)) == len(programs)
    normalized = [ast.dump(ast.parse(p)) for p in programs]
    assert len(set(normalized)) == len(normalized)


def test_messages_distinct():
    messages = [s.message.strip() for s in SEED_PROGRAMS]
    assert len(set(messages)) == len(messages)


def test_seed_is_frozen():
    with pytest.raises(Exception):
        SEED_PROGRAMS[0].program = "x"  # type: ignore[misc]


@pytest.mark.parametrize("seed", SEED_PROGRAMS, ids=IDS)
def test_seed_shape(seed: SeedProgram):
    assert isinstance(seed.program, str) and seed.program.strip()
    assert isinstance(seed.message, str) and seed.message.strip()
    assert "\n" not in seed.message.strip()
    assert isinstance(seed.inputs, tuple)
    assert 5 <= len(seed.inputs) <= 6
    assert all(isinstance(i, str) for i in seed.inputs)
    assert len(set(seed.inputs)) == len(seed.inputs), "inputs must be distinct"
    lines = [line for line in seed.program.splitlines() if line.strip()]
    assert 3 <= len(lines) <= 12, f"{len(lines)} non-blank lines"


@pytest.mark.parametrize("seed", SEED_PROGRAMS, ids=IDS)
def test_seed_parses_and_defines_one_top_level_f(seed: SeedProgram):
    tree = ast.parse(seed.program)
    top_f = [
        node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "f"
    ]
    assert len(top_f) == 1
    assert isinstance(top_f[0], ast.FunctionDef)
    for node in tree.body:
        # Only imports and function definitions at the top level.
        assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef)), ast.dump(node)


@pytest.mark.parametrize("seed", SEED_PROGRAMS, ids=IDS)
def test_seed_imports_only_allowed_modules(seed: SeedProgram):
    tree = ast.parse(seed.program)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in ALLOWED_MODULES, alias.name
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            assert node.module is not None
            assert node.module.split(".")[0] in ALLOWED_MODULES, node.module
        elif isinstance(node, ast.Name):
            assert node.id not in FORBIDDEN_NAMES, node.id
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            pytest.fail("global/nonlocal statements are not allowed")
        elif isinstance(node, ast.Attribute):
            assert not node.attr.startswith("__"), node.attr


@pytest.mark.parametrize("seed", SEED_PROGRAMS, ids=IDS)
def test_seed_inputs_are_literal_argument_lists(seed: SeedProgram):
    for input_text in seed.inputs:
        args = _literal_args(input_text)
        assert len(args) >= 1


@pytest.mark.parametrize("seed", SEED_PROGRAMS, ids=IDS)
def test_seed_runs_deterministically_with_literal_outputs(seed: SeedProgram):
    outputs = []
    for input_text in seed.inputs:
        first = _run(seed.program, input_text)
        second = _run(seed.program, input_text)
        assert first == second, input_text
        assert repr(first) == repr(second), input_text
        assert _is_plain_literal(first), f"{input_text!r} -> {first!r}"
        text = repr(first)
        assert ast.literal_eval(text) == first, input_text
        assert repr(ast.literal_eval(text)) == text, input_text
        outputs.append(text)
    # A seed whose outputs are all identical teaches nothing.
    assert len(set(outputs)) >= 2, outputs


_HASHSEED_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from driver.seeds import SEED_PROGRAMS
out = []
for seed in SEED_PROGRAMS:
    for inp in seed.inputs:
        ns = {"__name__": "seed_program"}
        exec(seed.program, ns)
        out.append(repr(eval("f(" + inp + ")", ns)))
print(json.dumps(out))
"""


def test_outputs_independent_of_hash_seed():
    results = []
    for hashseed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        proc = subprocess.run(
            [sys.executable, "-c", _HASHSEED_SCRIPT, str(ROOT)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1] == results[2]
