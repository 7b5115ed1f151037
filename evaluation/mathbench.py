"""Math: GSM-style problems generated offline (reasoning-gym's `gsm_symbolic`), and loaders
for GSM8K, MATH-500, AIME 24/25, AMC 23, Minerva and OlympiadBench from local JSONL files.

Prompt: the problem, then "Please reason step by step, and put your final answer within
\\boxed{}." (the usual Qwen-math instruction); no response prefix.

Extraction (`extract_final`): the content of the last `\\boxed{...}` (balanced braces),
else of the last `<answer>...</answer>`, else the text after the last "answer is", else
the last number in the completion.

Exact-answer check (`same_answer`): both sides are normalised (dollar signs, spaces,
`\\left`/`\\right`, `\\text{}`, `\\dfrac`, degree and percent signs, thousands separators,
a trailing period); numbers (integers, decimals, `a/b`, `\\frac{a}{b}`, a number followed by a
unit word) compare by value (relative tolerance 1e-6), anything else as the normalised
string. No code runs.
"""

from __future__ import annotations

import re
from fractions import Fraction

from evaluation import data_paths
from evaluation.problems import Benchmark, DataMissing, Problem, Verdict

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DEFAULT_PROBLEMS = 200
MAX_NEW_TOKENS = 384

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1] if depth == 0 else None


def extract_final(text: str) -> str | None:
    """The model's final answer (see the module docstring for the order of rules)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tagged = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    said = re.split(r"answer is[:\s]*", text, flags=re.IGNORECASE)
    if len(said) > 1 and said[-1].strip():
        return said[-1].strip().split("\n")[0].rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    s = str(answer).strip()
    s = re.sub(r"\\(?:text|textbf|mbox)\{(.*?)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("$", ""),
                     ("\\$", ""), (" ", "")):
        s = s.replace(old, new)
    s = re.sub(r"(\d),(?=\d{3}(?!\d))", r"\1", s)
    return s.rstrip(".").strip()


def _number(s: str) -> Fraction | None:
    m = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}|(-?[\d.]+)/(-?[\d.]+)", s)
    try:
        if m:
            num, den = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
            return Fraction(num) / Fraction(den)
        return Fraction(s) if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", s) else None
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(given: str | None, gold: str) -> bool:
    """Whether two final answers are equal by value (numbers) or as normalised text."""
    if given is None:
        return False
    a, b = normalize(given), normalize(gold)
    if a == b:
        return True
    x, y = _number(a), _number(b)
    if x is None and y is not None:  # "5cm" for a numeric gold: units are not part of the answer
        unit = re.fullmatch(r"(-?\d+(?:\.\d+)?)[A-Za-z]+", a)
        x = _number(unit.group(1)) if unit else None
    if x is None or y is None:
        return False
    return abs(x - y) <= Fraction(1, 10**6) * max(1, abs(y))


def score_math(problem: Problem, text: str, options: dict) -> Verdict:
    given = extract_final(text)
    if given is None:
        return Verdict(False, "no final answer")
    return Verdict(True) if same_answer(given, problem.gold["answer"]) else Verdict(False, f"answered {given[:40]!r}")


def _problem(benchmark: str, pid: str, question: str, answer: str) -> Problem:
    return Problem(benchmark, pid, f"{question.strip()}\n{INSTRUCTION}", max_new_tokens=MAX_NEW_TOKENS,
                   gold={"answer": str(answer).strip()})


def load_gsm_symbolic(limit: int | None, seed: int, options: dict) -> list[Problem]:
    """`limit` (default 200) problems from reasoning-gym's GSM-symbolic generators (offline)."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise DataMissing("the reasoning-gym package is not installed (pip install reasoning-gym)") from exc
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=limit or DEFAULT_PROBLEMS, seed=seed)
    return [_problem("gsm_symbolic", f"gsm_symbolic/{i}", entry["question"], entry["answer"])
            for i, entry in enumerate(dataset)]


_QUESTION_KEYS = ("problem", "question", "Problem", "Question", "prompt")
_ANSWER_KEYS = ("answer", "Answer", "final_answer", "expected_answer", "solution")


def _gold(rec: dict, key: str) -> str:
    value = rec[key]
    if isinstance(value, list):
        value = value[0] if value else ""
    value = str(value)
    if "####" in value:  # GSM8K: the reasoning, then "#### <number>"
        return value.split("####")[-1].strip()
    if key == "solution":
        return _last_boxed(value) or value
    if re.fullmatch(r"-?\d+\.0", value.strip()):  # AMC 23 stores integers as floats
        return value.strip()[:-2]
    return value


def _file_loader(name: str):
    def load(limit: int | None, seed: int, options: dict) -> list[Problem]:
        path = data_paths.find(name, options)
        problems = []
        for i, rec in enumerate(data_paths.read_records(path)):
            qkey = next((k for k in _QUESTION_KEYS if k in rec), None)
            akey = next((k for k in _ANSWER_KEYS if k in rec), None)
            if qkey is None or akey is None:
                raise DataMissing(f"{path}: record {i} has no question ({'/'.join(_QUESTION_KEYS)}) "
                                  f"or answer ({'/'.join(_ANSWER_KEYS)}) field")
            pid = f"{name}/{rec.get('id', rec.get('unique_id', i))}"
            problems.append(_problem(name, pid, rec[qkey], _gold(rec, akey)))
            if limit and len(problems) >= limit:
                break
        return problems
    load.__doc__ = f"{name} from a local JSONL file (--data {name}=PATH or ${data_paths.env_name(name)})."
    return load


FILE_SETS = ("gsm8k", "math500", "aime24", "aime25", "amc23", "minerva", "olympiadbench")

BENCHMARKS = (
    Benchmark("gsm_symbolic", load_gsm_symbolic, score_math,
              description="GSM-symbolic problems generated offline by reasoning-gym"),
    *(Benchmark(name, _file_loader(name), score_math, description=f"{name} (local JSONL)") for name in FILE_SETS),
)
