"""A checkpoint from elsewhere runs no code when loaded: a file holding a pickled object is
refused with one line naming it, even with the manifest's checksums made to match, no older
checkpoint is tried, and `populora train --resume` exits with code 2 before any work."""

from __future__ import annotations

import io
import json
import os
import pickle
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from driver import checkpoint
from driver.checkpoint import RefusedCheckpoint
from driver.cli import main
from driver.config import load_config

ROOT = Path(__file__).resolve().parents[1]


class RunsCode:
    """Unpickled, it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _payload(kind: str, marker: Path) -> bytes:
    state = {"adapters": {"teacher-0": RunsCode(f"touch {marker}")}}
    if kind == "torch.save":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()
    return pickle.dumps(state, protocol=2)


def _forge(directory: Path, filename: str, data: bytes) -> None:
    """Replace a file of a checkpoint and update the manifest to match, as a forger would."""
    (directory / filename).write_bytes(data)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][filename] = {"sha256": checkpoint._sha256(data), "bytes": len(data)}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _shared_run(tmp_path: Path, kind: str, marker: Path) -> Path:
    """A run directory with two intact checkpoints (steps 2 and 4), the newest one's learner.pt forged."""
    run = tmp_path / "shared"
    run.mkdir()
    cfg = load_config(ROOT / "configs/test.yaml", [f"run.output_dir={tmp_path}", "run.name=shared"])
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    for step in (2, 4):
        newest = checkpoint.save(run / "checkpoint", step, {"learner": {"w": torch.zeros(2)}, "driver": {"step": step}})
    _forge(newest, "learner.pt", _payload(kind, marker))
    return run


@pytest.fixture
def marker(tmp_path):
    return tmp_path / f"pwned-{uuid.uuid4().hex}"


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_the_payload_runs_code_when_loaded_the_old_way(kind, tmp_path):
    """The forged file is a real attack: what checkpoints were loaded with before runs it."""
    probe = tmp_path / f"probe-{uuid.uuid4().hex}"
    try:
        torch.load(io.BytesIO(_payload(kind, probe)), weights_only=False)
    except RuntimeError:  # a bare pickle: run as the legacy format's first record, then "invalid magic number"
        pass
    assert probe.exists()


@pytest.mark.parametrize("kind", ["torch.save", "pickle"])
def test_a_forged_file_is_refused_and_runs_nothing(kind, tmp_path, marker):
    run = _shared_run(tmp_path, kind, marker)
    with pytest.raises(RefusedCheckpoint) as refused:
        checkpoint.load_latest(run)  # the intact step 2 behind it is not tried either
    message = str(refused.value)
    assert message.startswith(f"{run / 'checkpoint' / 'learner.pt'}: refused: it holds a pickled object")
    assert "\n" not in message and len(message) < 400, message
    assert not marker.exists(), "the checkpoint ran a command"


def test_resume_from_a_forged_checkpoint_exits_2(tmp_path, marker, capsys, tiny_model_path):
    run = _shared_run(tmp_path, "torch.save", marker)
    assert main(["train", "--resume", str(run), "--log-level", "WARNING"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"populora: checkpoint error: {run / 'checkpoint' / 'learner.pt'}: refused"), err
    assert len(err.splitlines()) == 1, err
    assert not marker.exists(), "the checkpoint ran a command"
