"""Checkpoint files: atomic swap, checksums, and clear errors naming the bad file."""

import json

import pytest
import torch

from driver import checkpoint
from driver.checkpoint import CheckpointError


def _parts(value: float) -> dict:
    return {"learner": {"w": torch.full((3,), value)}, "driver": {"step_rows": [1, 2], "name": "x"}}


def test_roundtrip_and_swap(tmp_path):
    target = tmp_path / "checkpoint"
    checkpoint.save(target, 1, _parts(1.0))
    checkpoint.save(target, 2, _parts(2.0))
    step, parts = checkpoint.load(checkpoint.find(tmp_path))
    assert step == 2 and torch.equal(parts["learner"]["w"], torch.full((3,), 2.0))
    assert parts["driver"] == {"step_rows": [1, 2], "name": "x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_corrupt_file_is_named(tmp_path):
    target = checkpoint.save(tmp_path / "checkpoint", 1, _parts(1.0))
    data = bytearray((target / "learner.pt").read_bytes())
    data[-5] ^= 0xFF
    (target / "learner.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"learner\.pt: checksum mismatch"):
        checkpoint.load(target)


def test_partial_checkpoint_is_named(tmp_path):
    target = checkpoint.save(tmp_path / "checkpoint", 1, _parts(1.0))
    (target / "driver.pt").unlink()
    with pytest.raises(CheckpointError, match=r"driver\.pt: missing"):
        checkpoint.load(target)
    (target / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json: unreadable"):
        checkpoint.load(target)


def test_interrupted_swap_falls_back_to_the_previous_checkpoint(tmp_path):
    checkpoint.save(tmp_path / "checkpoint", 1, _parts(1.0))
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # killed between the two renames
    step, _ = checkpoint.load(checkpoint.find(tmp_path))
    assert step == 1
    assert json.loads((tmp_path / "checkpoint.old" / "manifest.json").read_text())["step"] == 1


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.find(tmp_path)
