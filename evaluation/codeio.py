"""Code reasoning: CodeI/O records (shipped in the `reasoning-gym` wheel) as held-out
code_i / code_o tasks in the training task format.

Conversion, all execution in the verifier sandbox:
1. `main_solution` is renamed `f`; records whose program does not pass the verifier's
   static screening (numpy, random, ...), already uses the name `f`, or is longer than
   `MAX_PROGRAM_CHARS` are dropped.
2. The record's own input generator runs in the sandbox with `random.Random(seed)`; its
   dict becomes a positional argument list in `main_solution`'s parameter order.
3. `verifier_sandbox.validate("code_o", ...)` runs `f` twice under different hash seeds:
   only deterministic runs with a literal output (at most `MAX_OUTPUT_CHARS`) are kept.
Each kept record gives one code_o task (predict the output) and one code_i task (find any
input that gives the output), so N tasks come from N/2 records, chosen in a fixed shuffled
order. These programs never appear in training (its seeds are driver/seeds.py and the
teachers' own proposals).

Prompts and extraction are the student's at training time (`driver.prompts.student_prompt`,
reply prefixed with `<answer>`, `driver.extraction.extract_answer`); `verifier_sandbox.check`
decides: code_o by value, code_i by running `f(answer)` in the sandbox. A run trained with
`tasks.reasoning` is asked the same way (options "reasoning"): a `<think>` section first,
the answer read after `</think>`, and the run's `tasks.solve_max_new_tokens` to do it in.
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

from evaluation.problems import Benchmark, DataMissing, Problem, Verdict
from driver.extraction import extract_answer
from driver.prompts import answer_prefix, student_prompt
from driver.records import Task
from verifier_sandbox import check, run_program, screen, validate
from verifier_sandbox.screening import literal, parse

DEFAULT_TASKS = 200
MAX_PROGRAM_CHARS = 1500
MAX_INPUT_CHARS = 300
MAX_OUTPUT_CHARS = 200
MAX_NEW_TOKENS = 128
TYPES = ("code_o", "code_i")


def _records() -> list[dict]:
    try:
        from reasoning_gym.data import get_data_file_path
    except ImportError as exc:
        raise DataMissing("the reasoning-gym package is not installed (pip install reasoning-gym)") from exc
    with gzip.open(get_data_file_path("codeio.jsonl.gz"), "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def as_program(code: str) -> tuple[str, list[str]] | None:
    """(program defining `f`, parameter names) for a record's code sample, or None."""
    tree = parse(code) if len(code) <= MAX_PROGRAM_CHARS else None
    if tree is None:
        return None
    main = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main_solution"]
    if len(main) != 1 or main[0].args.vararg or main[0].args.kwarg or main[0].args.kwonlyargs:
        return None
    names = {getattr(n, "id", None) or getattr(n, "name", None) or getattr(n, "arg", None) for n in ast.walk(tree)}
    if "f" in names:
        return None
    program = re.sub(r"\bmain_solution\b", "f", code)
    if screen(program):
        return None
    return program, [a.arg for a in main[0].args.args]


def _convert(rec: dict, seed: int) -> tuple[str, str, str] | None:
    """(program, input, output) of one record, or None when it cannot be a clean task."""
    try:
        converted = as_program(rec["code_sample"])
    except (SyntaxError, ValueError):
        return None
    if converted is None:
        return None
    program, params = converted
    run = run_program("from random import Random\n" + rec["input_generator"], f"generate_inputs(Random({seed}))",
                      timeout_s=5.0, memory_mb=512, screen=False)
    if run.status != "ok":
        return None
    try:
        args = literal(run.result)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if not isinstance(args, dict) or set(args) != set(params):
        return None
    text = ", ".join(repr(args[p]) for p in params)
    if len(text) > MAX_INPUT_CHARS:
        return None
    verdict = validate("code_o", program, input=text, reject_trivial=False, strip_dead=False)  # a fixed benchmark
    if not verdict.valid or len(verdict.output) > MAX_OUTPUT_CHARS:
        return None
    return program, text, verdict.output


def load_codeio(limit: int | None, seed: int, options: dict) -> list[Problem]:
    """`limit` (default 200) tasks, half code_o and half code_i, from a fixed shuffle."""
    wanted = limit or DEFAULT_TASKS
    records = _records()
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    tasks: list[tuple[int, str, str, str]] = []
    workers = int(options.get("workers", 2))
    with ThreadPoolExecutor(workers) as pool:
        for start in range(0, len(order), 8 * workers):
            if len(tasks) * 2 >= wanted:
                break
            chunk = order[start:start + 8 * workers]
            for idx, done in zip(chunk, pool.map(lambda i: _convert(records[i], seed + i), chunk)):
                if done:
                    tasks.append((idx, *done))
    problems = []
    reasoning = bool(options.get("reasoning", False))
    budget = int(options.get("solve_max_new_tokens") or MAX_NEW_TOKENS) if reasoning else MAX_NEW_TOKENS
    for idx, program, inp, out in tasks:
        for task_type in TYPES:
            task = Task(task_type, program, input=inp, output=out, teacher="codeio")
            problems.append(Problem("codeio", f"codeio/{idx}/{task_type}", student_prompt(task, reasoning),
                                    prefix=answer_prefix("student", task_type, reasoning), group=task_type,
                                    stop=("</answer>",), max_new_tokens=budget,
                                    gold={"program": program, "input": inp, "output": out}))
    return problems[:wanted]


def score_codeio(problem: Problem, text: str, options: dict) -> Verdict:
    answer = extract_answer(problem.prefix + text, reasoning=bool(options.get("reasoning", False)))
    if answer is None:
        return Verdict(False, "malformed: no <answer> block")
    g = problem.gold
    verdict = check(problem.group, g["program"], answer, input=g["input"], output=g["output"],
                    timeout_s=float(options.get("timeout_s", 10.0)) / 2)
    return Verdict(verdict.correct, verdict.reason or "")


BENCHMARKS = (
    Benchmark("codeio", load_codeio, score_codeio,
              description="CodeI/O records from the reasoning-gym wheel as code_i/code_o tasks"),
)
