"""logging.tensorboard / logging.wandb: the metrics.parquet scalars, read back from the trackers' own files."""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import pytest

from driver.config import ConfigError, load_config
from driver.trackers import Trackers, is_step_wide, read_tensorboard, scalars

MEMBERS = ("teacher-0", "student-0")


def _rows(step: int, shift: float = 0.0) -> list[dict]:
    """Metrics rows shaped like record_step's: per-member columns, step-wide columns, non-numeric ones."""
    return [{"step": step, "member": m, "role": m.split("-")[0], "alive": True, "roles_played": "teacher",
             "teacher/reward": 0.25 * step + i + shift, "student/solve_rate": None if i == 0 else 0.5 + shift,
             "learner/signal_share": 0.1 * step, "population/trueskill_mu": 25.0 - step - i,
             "population/coverage": 3 * step, "time/propose": 1.5 * step + shift, "time/step": 4.0 * step}
            for i, m in enumerate(MEMBERS)]


def _config(tmp_path: Path, *overrides: str):
    return load_config(None, ["model.path=embedded:tiny-llama", f"run.output_dir={tmp_path}", *overrides])


def expected_scalars(rows_by_step: dict[int, list[dict]]) -> dict[tuple[str, str, int], float]:
    """What the TensorBoard directory should hold for these metrics rows."""
    want = {}
    for step, rows in rows_by_step.items():
        for row in rows:
            for column, value in scalars(row).items():
                want[("" if is_step_wide(column) else row["member"], column, step)] = value
    return want


def assert_same_scalars(found: dict, want: dict) -> None:
    assert set(found) == set(want), f"missing {sorted(set(want) - set(found))}, extra {sorted(set(found) - set(want))}"
    for key, value in want.items():  # event files store float32
        assert math.isclose(found[key], value, rel_tol=1e-6, abs_tol=1e-6), (key, found[key], value)


def test_tensorboard_events_hold_the_metrics_scalars_under_their_column_names(tmp_path):
    trackers = Trackers.open(_config(tmp_path, "logging.tensorboard=true"), tmp_path / "run")
    rows = {step: _rows(step) for step in (1, 2, 3)}
    for step, step_rows in rows.items():
        trackers.log(step, step_rows)
    trackers.close()

    found = read_tensorboard(tmp_path / "run" / "tensorboard")
    assert_same_scalars(found, expected_scalars(rows))
    assert ("teacher-0", "teacher/reward", 2) in found and ("", "time/propose", 2) in found
    assert not any(tag in ("step", "alive", "role") for _, tag, _ in found)


def test_replayed_steps_replace_the_abandoned_ones(tmp_path):
    """A recovery in the same process, then a resume in a new one: each step is seen once, last values win."""
    cfg = _config(tmp_path, "logging.tensorboard=true")
    trackers = Trackers.open(cfg, tmp_path / "run")
    for step in (1, 2, 3):
        trackers.log(step, _rows(step))
    time.sleep(1.1)  # event file names start with whole seconds: the replay's files must sort after
    trackers.log(2, _rows(2, shift=10.0))  # restored to checkpoint 1 and replayed step 2
    trackers.close()
    time.sleep(1.1)
    resumed = Trackers.open(cfg, tmp_path / "run")  # --resume from checkpoint 2, in a new process
    resumed.log(3, _rows(3, shift=20.0))
    resumed.close()

    found = read_tensorboard(tmp_path / "run" / "tensorboard")
    assert_same_scalars(found, expected_scalars({1: _rows(1), 2: _rows(2, 10.0), 3: _rows(3, 20.0)}))


def test_no_tracker_by_default_and_bad_logging_keys_name_the_key(tmp_path):
    trackers = Trackers.open(_config(tmp_path), tmp_path / "run")
    trackers.log(1, _rows(1))
    trackers.close()
    assert not (tmp_path / "run").exists()
    for override, key in (("logging.tensorboard=maybe", "logging.tensorboard"),
                          ("logging.wandb_mode=cloud", "logging.wandb_mode"),
                          ("logging.tensorbord=true", "logging.tensorbord"),
                          ("logging=true", "logging")):
        with pytest.raises(ConfigError, match=rf"^{key}:"):
            _config(tmp_path, override)


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline `.wandb` file (LevelDB log format: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]  # ident, magic 0xBEE1, version 0
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_logs_offline_the_same_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import json

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    run_path = tmp_path / "run"
    trackers = Trackers.open(_config(tmp_path, "logging.wandb=true", "run.name=wb"), run_path)
    for step in (1, 2):
        trackers.log(step, _rows(step))
    trackers.close()

    (offline,) = (run_path / "wandb").glob("offline-run-*/run-*.wandb")  # offline by default
    history = []
    for record in _wandb_records(offline):
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    by_step = {h["step"]: h for h in history}
    assert sorted(by_step) == [1, 2], history
    for step in (1, 2):
        for row in _rows(step):
            for column, value in scalars(row).items():
                key = column if is_step_wide(column) else f"{column}/{row['member']}"
                assert math.isclose(by_step[step][key], value), (step, key, by_step[step].get(key), value)
