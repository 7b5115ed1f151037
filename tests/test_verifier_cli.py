"""The JSON Lines CLI (`python -m verifier_sandbox`) and the `handle` contract behind it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from verifier_sandbox import handle
from verifier_sandbox.__main__ import serve

ROOT = Path(__file__).resolve().parents[1]
SORT = "def f(a, b):\n    return sorted(a)[:b]"


def _serve(op: str, lines: list[str], workers: int = 2) -> list[dict]:
    out = io.StringIO()
    serve(op, iter(line + "\n" for line in lines), out, workers)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_cli_subprocess_streams_one_line_per_request_in_order():
    requests = [json.dumps({"task_type": "code_o", "program": SORT, "input": f"[{i}, 0, 9], 1"})
                for i in range(6)]
    requests.insert(3, "{not json")
    proc = subprocess.run([sys.executable, "-m", "verifier_sandbox", "validate"], cwd=ROOT,
                          input="\n".join(requests) + "\n", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(replies) == 7
    assert replies[3]["valid"] is False and "invalid JSON" in replies[3]["error"]
    outputs = [r["output"] for i, r in enumerate(replies) if i != 3]
    assert outputs == [repr([min(i, 0)]) for i in range(6)]


def test_serve_run_and_check():
    run = _serve("run", [json.dumps({"program": SORT, "call": "f([2, 1], 1)"}),
                         json.dumps({"program": "def f():\n    return 1 / 0"}), "[]"])
    assert run[0] == {"status": "ok", "result": "[1]", "stdout": ""}
    assert run[1]["status"] == "error" and "ZeroDivisionError" in run[1]["error"]
    assert set(run[2]) == {"error"}
    check = _serve("check", [json.dumps({"task_type": "code_o", "output": "3", "answer": "3"}),
                             json.dumps({"task_type": "code_o", "output": "3", "answer": "x"}),
                             "", "null"])
    assert check[0] == {"correct": True}
    assert check[1] == {"correct": False, "reason": "malformed"}
    for reply in check[2:]:
        assert reply["correct"] is False and "error" in reply


def test_handle_never_raises_on_bad_requests():
    for op in ("run", "validate", "check"):
        for request in (None, [], {"program": 3}, {"task_type": "code_x", "program": SORT,
                                                  "answer": "1"},
                        {"program": SORT, "task_type": "code_o", "input": "1",
                         "timeout_s": "soon", "answer": "1"}):
            reply = handle(op, request)
            assert isinstance(reply, dict)
            if op == "validate":
                assert reply["valid"] is False
            if op == "check":
                assert reply["correct"] is False
    assert "error" in handle("explode", {})


def test_handle_validate_and_limits():
    reply = handle("validate", {"task_type": "code_f", "program": SORT,
                                "inputs": ["[2, 1], 1", "[5, 4, 3], 2"], "timeout_s": 2})
    assert reply == {"valid": True, "outputs": ["[1]", "[3, 4]"]}
    slow = handle("run", {"program": "def f():\n    while True:\n        pass",
                          "timeout_s": 0.3})
    assert slow["status"] == "timeout"


def test_a_typed_request_is_the_json_contract():
    """`Request.to_dict` is what the CLI reads: the same verdict either way."""
    from verifier_sandbox import Request, handle

    r = Request("code_o", "def f(x):\n    return x * 3", input="4", output="12", answer="12")
    assert r.to_dict() == {"task_type": "code_o", "program": "def f(x):\n    return x * 3", "input": "4",
                           "output": "12", "answer": "12"}
    assert handle("check", r.to_dict())["correct"] is True
    f = Request("code_f", "def f(x):\n    return x + 1", inputs=("1", "2"), reject_trivial=True)
    assert f.to_dict()["inputs"] == ["1", "2"] and handle("validate", f.to_dict())["outputs"] == ["2", "3"]
