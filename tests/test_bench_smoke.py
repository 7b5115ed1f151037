"""Every benchmark's CLI parses (nothing heavy runs: `--help` exits before any model loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["multilora", "learner", "sync", "memory"])
def test_bench_cli_help(name):
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"bench.{name} --help failed: {proc.stderr[-500:]}"
    assert "--quick" in proc.stdout, f"bench.{name} has no --quick option: {proc.stdout}"
