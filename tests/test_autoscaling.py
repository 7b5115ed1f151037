"""Ray's autoscaler adds `verifier` nodes for a VerifierPool burst and removes them once idle.

The cluster, the burst and the cleanup live in examples/autoscaling_demo.py, run here as its
own process: it owns a Ray head of its own (temp dir, ports) and ends every process it
started, so the embedded Ray session of the other tests is untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_autoscaler_starts_verifier_nodes_for_a_burst_and_removes_them_when_idle(tmp_path):
    out = tmp_path / "autoscaling.json"
    deadline_s = 300
    proc = subprocess.run([sys.executable, str(ROOT / "examples/autoscaling_demo.py"), "--out", str(out),
                           "--deadline-s", str(deadline_s)],
                          capture_output=True, text=True, timeout=deadline_s + 120, cwd=ROOT)
    assert out.is_file(), f"no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    s = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in s.items() if k != "autoscaler_log_tail"}, indent=1))  # seen with -s
    log = s.get("autoscaler_log_tail", "")
    assert "error" not in s, f"{s['error']}\nautoscaler log:\n{log}"
    assert s["verifier_nodes_at_start"] == 0, "the head must offer no verifier resource"
    assert s["answers"] == s["requests"] == s["correct_answers"], \
        f"expected each of {s['requests']} requests answered once and right, got {s['answers']} answers, " \
        f"{s['correct_answers']} right"
    assert 1 <= s["verifier_nodes_launched"] <= 2, f"expected 1-2 verifier nodes, saw {s['verifier_nodes_launched']}"
    assert s["seconds_to_first_node"] is not None and s["seconds_to_first_node"] > 0
    assert s["pool_peak_size"] > 1, "the burst should have made the pool grow"
    assert any("Adding" in e and "verifier" in e for e in s["autoscaler_events"]), s["autoscaler_events"]
    assert s["scaled_down"], f"verifier nodes still up after the burst; autoscaler log:\n{log}"
    assert any("Removing" in e and "verifier" in e and "idle" in e for e in s["autoscaler_events"]), \
        s["autoscaler_events"]
    assert s["ended_processes"] > 0, "the demo should have ended the processes of its own cluster"
