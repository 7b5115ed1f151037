"""The in-distribution probe: a fixed, held-out set of programs asked as training asks them.

Twelve small programs, none of them a seed program (`driver/seeds.py`; tests/test_study.py
checks their `ast_hash`es differ) nor a CodeI/O record, each with six literal inputs and a
one-line hint. Each program gives one task of every training type:

- code_o: the program and `inputs[0]`; predict the output;
- code_i: the program and the output of `f(inputs[1])`; give any input that produces it;
- code_f: the first `tasks.induction_inputs` inputs (all six when the config asks for more)
  with their outputs and the hint; the first `tasks.induction_shown` pairs are shown (at
  most all but one), the rest decide.

Gold outputs come from the verifier sandbox at load time. Prompts, reply prefix and
sampling are training's own (`driver.loop.sampling(..., greedy=True)`, `student_prompt`,
the constrained reply format when the run used it), so the probe measures the skill a
student trains on, on programs no run has seen; decoding is greedy, so every run answers the
same problems the same way given the same weights. Answers are read and checked as in
training (`extract_answer`, `verifier_sandbox.check` on the held-out pairs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from driver.config import Config
from driver.records import Task

HOLDOUT_PROGRAMS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "def f(s):\n"
        "    out = []\n"
        "    for i, ch in enumerate(s):\n"
        "        out.append(ch.upper() if i % 2 == 0 else ch.lower())\n"
        "    return ''.join(out)\n",
        ("'banana'", "'Hello'", "'xyz'", "''", "'PyThOn'", "'ab cd'"),
        "Alternates the letters between upper case (even positions) and lower case (odd positions).",
    ),
    (
        "def f(nums):\n"
        "    return [b - a for a, b in zip(nums, nums[1:])]\n",
        ("[1, 4, 9, 16]", "[5, 5, 5]", "[10]", "[3, -2, 7, 0]", "[]", "[0, 1, 3, 6, 10]"),
        "Returns the differences between consecutive numbers.",
    ),
    (
        "def f(n):\n"
        "    bits = 0\n"
        "    while n:\n"
        "        bits += n & 1\n"
        "        n >>= 1\n"
        "    return bits\n",
        ("5", "0", "255", "1024", "7", "100"),
        "Counts the ones in the binary form of a non-negative integer.",
    ),
    (
        "def f(words, n):\n"
        "    return [w for w in words if len(w) > n]\n",
        ("['a', 'abc', 'ab'], 1", "['tree', 'sky', 'mountain'], 3", "[], 2", "['x', 'yy'], 5",
         "['one', 'three', 'five'], 4", "['go', 'stop'], 0"),
        "Keeps the words longer than n, in their order.",
    ),
    (
        "def f(s):\n"
        "    depth = 0\n"
        "    for ch in s:\n"
        "        depth += 1 if ch == '(' else -1\n"
        "        if depth < 0:\n"
        "            return False\n"
        "    return depth == 0\n",
        ("'(())'", "'(()'", "')('", "''", "'()()()'", "'((())())'"),
        "Tells whether a string of parentheses is balanced.",
    ),
    (
        "def f(nums):\n"
        "    evens = sorted(x for x in nums if x % 2 == 0)\n"
        "    odds = sorted(x for x in nums if x % 2)\n"
        "    return evens + odds\n",
        ("[3, 2, 1, 4]", "[7, 5]", "[8, 6, 4]", "[]", "[0, -1, -2, 3]", "[10, 9, 8, 7, 6]"),
        "Sorts the even numbers first, then the odd numbers, each group ascending.",
    ),
    (
        "def f(a, b):\n"
        "    return sum(x * y for x, y in zip(a, b))\n",
        ("[1, 2, 3], [4, 5, 6]", "[0, 0], [9, 9]", "[2], [7]", "[], []", "[-1, 1], [1, 1]",
         "[3, 0, 2], [1, 5, 4]"),
        "Returns the dot product of two lists of numbers.",
    ),
    (
        "def f(s):\n"
        "    return s[::2] + s[1::2]\n",
        ("'abcdef'", "'hello'", "'a'", "''", "'12345678'", "'xy'"),
        "Puts the characters at even positions first, then those at odd positions.",
    ),
    (
        "def f(n):\n"
        "    total = 0\n"
        "    for d in range(1, n):\n"
        "        if n % d == 0:\n"
        "            total += d\n"
        "    return total\n",
        ("6", "12", "1", "28", "7", "15"),
        "Sums the proper divisors of n (the divisors smaller than n).",
    ),
    (
        "def f(grid):\n"
        "    return [sum(row) for row in grid]\n",
        ("[[1, 2], [3, 4]]", "[[5]]", "[]", "[[0, 0, 0], [1, 1, 1]]", "[[-1, 2, -3]]", "[[2, 2], [3], [4, 5, 6]]"),
        "Returns the sum of each row of a grid.",
    ),
    (
        "def f(s, c):\n"
        "    return [i for i, ch in enumerate(s) if ch == c]\n",
        ("'banana', 'a'", "'hello', 'l'", "'abc', 'z'", "'', 'x'", "'aaaa', 'a'", "'mississippi', 's'"),
        "Lists the positions at which the character c occurs in the string.",
    ),
    (
        "def f(nums, k):\n"
        "    best = None\n"
        "    for i in range(len(nums) - k + 1):\n"
        "        window = sum(nums[i:i + k])\n"
        "        if best is None or window > best:\n"
        "            best = window\n"
        "    return best\n",
        ("[1, 3, 2, 5], 2", "[4, 4, 4], 1", "[1, 2], 3", "[-5, -1, -3], 2", "[2, 7, 1, 8, 2], 3", "[9], 1"),
        "Returns the largest sum of k consecutive numbers, or None when the list is shorter than k.",
    ),
)


@dataclass(frozen=True)
class InDistributionResult:
    """One member's greedy answer to one probe task."""

    member: str
    problem: str  # "probe/<program index>/<task type>"
    task_type: str
    correct: bool
    reason: str


def in_distribution_tasks(cfg: Config, limit: int | None = None, timeout_s: float = 5.0) -> list[tuple[str, Task]]:
    """(problem id, task) for the config's task types, at most `limit` per type, gold outputs
    from the sandbox. Programs whose gold output cannot be computed fail loudly: the set is
    fixed, so that is a broken sandbox, not a bad program."""
    from verifier_sandbox import validate

    # the set is a fixed benchmark, asked as it always was: the training rules for proposals
    # (trivial tasks refused, dead code stripped) would change its problems and its scores
    rules = {"reject_trivial": False, "strip_dead": False}
    t = cfg.tasks
    tasks: list[tuple[str, Task]] = []
    for task_type in t.types:
        for index, (program, inputs, message) in enumerate(HOLDOUT_PROGRAMS[:limit] if limit else HOLDOUT_PROGRAMS):
            pid = f"probe/{index}/{task_type}"
            if task_type == "code_f":
                shown_inputs = list(inputs[: t.induction_inputs])
                v = validate("code_f", program, inputs=shown_inputs, timeout_s=timeout_s, **rules)
                if not v.valid:
                    raise RuntimeError(f"probe program {index}: the sandbox rejected it ({v.reason})")
                shown = min(t.induction_shown, len(shown_inputs) - 1)
                tasks.append((pid, Task("code_f", program, inputs=tuple(shown_inputs), outputs=tuple(v.outputs),
                                        message=message, shown=shown, teacher="probe")))
            else:
                inp = inputs[0] if task_type == "code_o" else inputs[1]
                v = validate(task_type, program, input=inp, timeout_s=timeout_s, **rules)
                if not v.valid:
                    raise RuntimeError(f"probe program {index}: the sandbox rejected it ({v.reason})")
                tasks.append((pid, Task(task_type, program, input=inp, output=v.output, teacher="probe")))
    return tasks


def run_in_distribution(cfg: Config, engine, members: Sequence[str], tasks: list[tuple[str, Task]],
              timeout_s: float = 5.0) -> list[InDistributionResult]:
    """Every member answers every task once, greedily, in one batched call of `engine`
    (the interface of `actors.inference.create_engine`; adapters already synced)."""
    from driver.extraction import extract_answer
    from driver.loop import check_request, sampling
    from driver.prompts import student_prompt
    from verifier_sandbox import check

    jobs = [(m, pid, task) for m in members for pid, task in tasks]
    settings = [sampling(cfg, "student", task.task_type, greedy=True) for _, _, task in jobs]
    prompts = [student_prompt(task, cfg.tasks.reasoning) for _, _, task in jobs]
    outputs = engine.generate([m for m, _, _ in jobs], prompts, [params for params, _ in settings],
                              [prefix for _, prefix in settings])
    results = []
    for (member, pid, task), (_, prefix), out in zip(jobs, settings, outputs):
        answer = extract_answer(prefix + out.completions[0].text, cfg.tasks.require_answer_close, cfg.tasks.reasoning)
        if answer is None:
            results.append(InDistributionResult(member, pid, task.task_type, False, "malformed"))
            continue
        r = check_request(task, answer)
        verdict = check(r.task_type, r.program, r.answer, input=r.input, output=r.output,
                        inputs=list(r.inputs) if r.inputs is not None else None,
                        outputs=list(r.outputs) if r.outputs is not None else None, timeout_s=timeout_s)
        results.append(InDistributionResult(member, pid, task.task_type, verdict.correct, verdict.reason or ""))
    return results
