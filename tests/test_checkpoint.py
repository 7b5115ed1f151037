"""Checkpoint files: atomic swap, the checkpoints kept, checksums, clear errors naming the
bad file, and the records, tuples, sets and RNG states a run saves coming back equal."""

import dataclasses
import io
import json
import logging
import random

import numpy as np
import pytest
import torch

from driver import checkpoint
from driver.checkpoint import CheckpointError, RefusedCheckpoint
from driver.collapse import WorkFlags
from driver.records import Proposal, Rollout, Task


def _parts(value: float) -> dict:
    return {"learner": {"w": torch.full((3,), value)}, "driver": {"step_rows": [1, 2], "name": "x"}}


def _names(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_roundtrip_and_swap(tmp_path):
    target = tmp_path / "checkpoint"
    checkpoint.save(target, 1, _parts(1.0))
    checkpoint.save(target, 2, _parts(2.0))
    step, parts = checkpoint.load(checkpoint.find(tmp_path))
    assert step == 2 and torch.equal(parts["learner"]["w"], torch.full((3,), 2.0))
    assert parts["driver"] == {"step_rows": [1, 2], "name": "x"}
    assert _names(tmp_path) == ["checkpoint", "checkpoint.1"]  # keep=2: the newest and the one before


def test_the_newest_keep_checkpoints_are_kept(tmp_path):
    for step in range(0, 12, 2):
        checkpoint.save(tmp_path / "checkpoint", step, _parts(float(step)), keep=3)
    assert _names(tmp_path) == ["checkpoint", "checkpoint.6", "checkpoint.8"]
    assert [checkpoint.load(d)[0] for d in checkpoint.candidates(tmp_path)] == [10, 8, 6]
    checkpoint.save(tmp_path / "checkpoint", 12, _parts(12.0), keep=1)
    assert _names(tmp_path) == ["checkpoint"]


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


def test_a_truncated_newest_checkpoint_resumes_from_the_one_before(tmp_path, caplog):
    checkpoint.save(tmp_path / "checkpoint", 8, _parts(8.0))
    target = checkpoint.save(tmp_path / "checkpoint", 10, _parts(10.0))
    data = (target / "learner.pt").read_bytes()
    (target / "learner.pt").write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="driver.checkpoint"):
        step, parts, path = checkpoint.load_latest(tmp_path)
    assert (step, path.name) == (8, "checkpoint.8")
    assert torch.equal(parts["learner"]["w"], torch.full((3,), 8.0))
    assert ("checkpoint step 10 is corrupt (learner.pt: checksum mismatch); resuming from step 8"
            in caplog.text), caplog.text
    # the run goes on from step 8: its next checkpoint 10 replaces the corrupt one, 8 stays
    checkpoint.save(tmp_path / "checkpoint", 10, _parts(10.5))
    assert _names(tmp_path) == ["checkpoint", "checkpoint.8"]
    assert torch.equal(checkpoint.load_latest(tmp_path)[1]["learner"]["w"], torch.full((3,), 10.5))


def test_no_intact_checkpoint_names_each(tmp_path):
    target = checkpoint.save(tmp_path / "checkpoint", 2, _parts(2.0), keep=1)
    (target / "driver.pt").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint \(checkpoint step 2 is incomplete "
                                              r"\(driver\.pt: missing"):
        checkpoint.load_latest(tmp_path)


def test_interrupted_swap_falls_back_to_the_previous_checkpoint(tmp_path):
    checkpoint.save(tmp_path / "checkpoint", 1, _parts(1.0))
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # killed between the two renames
    step, _ = checkpoint.load(checkpoint.find(tmp_path))
    assert step == 1
    assert json.loads((tmp_path / "checkpoint.old" / "manifest.json").read_text())["step"] == 1
    # killed after the newest was moved aside, before the new one took its name
    checkpoint.save(tmp_path / "checkpoint", 3, _parts(3.0))
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.3")
    (tmp_path / "checkpoint.tmp").mkdir()
    assert checkpoint.load_latest(tmp_path)[0] == 3


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.find(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.load_latest(tmp_path)


# ---- what a run saves -------------------------------------------------------------------
def _roundtrip(value):
    buffer = io.BytesIO()
    torch.save(checkpoint.encode(value), buffer)
    return checkpoint.decode(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))


def _records():
    task = Task("code_f", "def f(x):\n    return x", inputs=("1", "2"), outputs=("1", "2"), message="m", shown=1,
                teacher="teacher-0", step=3)
    proposal = Proposal("teacher-0", "code_f", (1, 2), (3, 4), "text", task.program, None, ("1",), "msg", True,
                        None, task, supplied=(True, False), logprobs=(-0.5, -1.25))
    rollout = Rollout("student-1", 0, (5,), (6, 7), "1", True, False, 1.0, logprobs=(-0.1, -0.2))
    return task, proposal, rollout


def test_records_and_rng_states_come_back_equal():
    from driver.loop import Experience

    task, proposal, rollout = _records()
    pending = Experience(step=4, version=3, matches={"teacher-0": "student-1"}, proposals=[proposal], tasks=[task],
                        rollouts=[rollout], rates=[0.5], teacher_rewards=[np.float64(0.25)], seconds={"propose": 1.5},
                        work=[WorkFlags("h", 7, False, None)])
    state = {
        "pending": pending, "seeds": {"code_f": [task, task]}, "python_random": random.getstate(),
        "numpy_random": np.random.get_state(), "rng": np.random.default_rng(7).bit_generator.state,
        "torch_random": torch.get_rng_state(), "children": {"a", "b"}, "seen": {("h", 1): (2, 0.5)},
        "scalar": np.int32(-3), "array": np.arange(6, dtype=np.uint16).reshape(2, 3).T, "tricky": {"__checkpoint__": 1},
    }
    back = _roundtrip(state)
    assert back["pending"] == pending and back["seeds"] == state["seeds"]
    assert back["pending"].tasks[0] is back["pending"].proposals[0].task, "shared records stay shared"
    assert back["pending"].proposal_rates == [0.5]
    assert type(back["pending"].teacher_rewards[0]) is np.float64
    assert back["seeds"]["code_f"][0] is back["seeds"]["code_f"][1]
    assert back["python_random"] == state["python_random"]
    assert back["rng"] == state["rng"] and back["children"] == {"a", "b"} and back["seen"] == {("h", 1): (2, 0.5)}
    assert type(back["scalar"]) is np.int32 and back["scalar"] == -3
    assert back["array"].dtype == np.uint16 and (back["array"] == state["array"]).all()
    assert back["tricky"] == {"__checkpoint__": 1}
    assert torch.equal(back["torch_random"], state["torch_random"])
    np.random.set_state(back["numpy_random"])
    draws = np.random.random(3)
    np.random.set_state(state["numpy_random"])
    assert (draws == np.random.random(3)).all()


def test_a_field_missing_from_a_checkpoint_takes_its_default_and_unknown_names_are_refused():
    task = _records()[0]
    encoded = checkpoint.encode(task)
    del encoded["fields"]["message"]
    assert checkpoint.decode(encoded) == dataclasses.replace(task, message="")
    encoded["fields"]["surprise"] = 1
    with pytest.raises(ValueError, match="no field surprise"):
        checkpoint.decode(encoded)
    with pytest.raises(ValueError, match="record type 'os.Evil'"):
        checkpoint.decode({"__checkpoint__": "record", "type": "os.Evil", "id": 0, "fields": {}})
    with pytest.raises(ValueError, match="tag 'call'"):
        checkpoint.decode({"__checkpoint__": "call"})


def test_a_value_without_an_encoding_fails_the_save_naming_where(tmp_path):
    @dataclasses.dataclass
    class Unlisted:
        x: int = 0

    with pytest.raises(TypeError, match=r"driver\['pending'\]\[0\]: cannot checkpoint a .*Unlisted"):
        checkpoint.save(tmp_path / "checkpoint", 1, {"driver": {"pending": [Unlisted()]}})
    assert not (tmp_path / "checkpoint").exists()


def test_an_unknown_record_in_a_file_is_refused(tmp_path):
    target = checkpoint.save(tmp_path / "checkpoint", 1, _parts(1.0))
    data = io.BytesIO()
    torch.save({"__checkpoint__": "record", "type": "builtins.eval", "id": 0, "fields": {}}, data)
    _forge(target, "driver.pt", data.getvalue())
    with pytest.raises(RefusedCheckpoint, match=r"driver\.pt: refused: it holds record type 'builtins\.eval'"):
        checkpoint.load_latest(tmp_path)


def test_format_1_checkpoints_are_refused(tmp_path):
    target = checkpoint.save(tmp_path / "checkpoint", 1, _parts(1.0))
    manifest = json.loads((target / "manifest.json").read_text())
    (target / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(RefusedCheckpoint, match=r"manifest\.json: checkpoint format 1"):
        checkpoint.load(target)


def _forge(directory, filename: str, data: bytes) -> None:
    """Replace a file of a checkpoint and update its manifest to match, as a forger would."""
    (directory / filename).write_bytes(data)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][filename] = {"sha256": checkpoint._sha256(data), "bytes": len(data)}
    (directory / "manifest.json").write_text(json.dumps(manifest))
