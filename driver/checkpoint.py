"""Checkpoints: everything needed to resume a run bit-for-bit, written atomically.

`runs/<name>/checkpoint/` holds one file per owner (the learner's adapters and AdamW
states, the inference engine's sampling RNG, the population's ratings and matchmaking
RNG, the driver's buffers, RNGs, table rows and step) plus `manifest.json` with each
file's SHA-256. A new checkpoint is written beside the old one and swapped in with
renames, so a kill at any moment leaves either the old or the new checkpoint whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A missing, partial or corrupt checkpoint; the message names the file."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, step: int, parts: dict[str, Any]) -> Path:
    """Write `parts` (name -> picklable state, tensors included) as checkpoint `directory`."""
    tmp = directory.with_name(directory.name + ".tmp")
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for name, state in parts.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        with open(tmp / f"{name}.pt", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        files[f"{name}.pt"] = {"sha256": _sha256(data), "bytes": len(data)}
    (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
    _fsync_dir(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    _fsync_dir(directory.parent)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def find(run: Path) -> Path:
    """The checkpoint directory of a run, falling back to the previous one if a swap was cut short."""
    for candidate in (run / "checkpoint", run / "checkpoint.old"):
        if (candidate / MANIFEST).is_file():
            return candidate
    raise CheckpointError(f"{run / 'checkpoint' / MANIFEST}: no checkpoint in {run}")


def load(directory: Path) -> tuple[int, dict[str, Any]]:
    """(step, parts) from a checkpoint directory, every file verified against the manifest."""
    manifest_path = directory / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        step, files = int(manifest["step"]), manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (partial checkpoint?)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
    parts = {}
    for filename, meta in files.items():
        path = directory / filename
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (partial checkpoint?)") from None
        if len(data) != meta["bytes"] or _sha256(data) != meta["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (corrupt checkpoint)")
        parts[filename[: -len(".pt")]] = torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")
    return step, parts
