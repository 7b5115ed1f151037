"""Checkpoints: everything needed to resume a run bit-for-bit, safe to load, written atomically.

`runs/<name>/checkpoint/` is the newest checkpoint; the `keep - 1` before it
(`run.keep_checkpoints`) sit beside it as `checkpoint.<step>/`. Each holds one file per
owner (the learner's adapters and AdamW states, the inference engine's sampling RNG, the
population's ratings and matchmaking RNG, the driver's buffers, RNGs, table rows and step)
plus `manifest.json` with each file's SHA-256.

The files hold tensors and plain data only (None, bool, int, float, str, bytes, list, dict)
and are read with `torch.load(..., weights_only=True)`: a file that holds any other pickled
object is refused (`RefusedCheckpoint`), whatever the manifest says, so loading a run
directory from elsewhere runs no code from it. What the owners hand over is encoded into
that plain data here (`encode` / `decode`): a record of a type in `RECORDS` becomes a tagged
dict of its dataclass fields (a field added later is carried without a change here; a
checkpoint without it gets the field's default), tuples, sets and dicts with other keys
become tagged lists, NumPy arrays and scalars become byte tensors with their dtype. A
record shared by several places comes back shared, as pickle would give it. A tag or a
record type not known here is refused on load.

A new checkpoint is written beside the newest one and swapped in with renames, so a kill at
any moment leaves the previous checkpoints whole. A resume takes the newest intact one and
says why it skipped any newer ones (`load_latest`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
NAME = "checkpoint"  # runs/<name>/checkpoint/: the newest; checkpoint.<step>/: the ones kept before it
FORMAT = 3  # 1: pickled records, loaded with weights_only=False; 2: the table rows too (both refused)
TAG = "__checkpoint__"

# The record types a checkpoint may hold, by module and qualified name (resolved on use:
# driver.loop imports this module).
RECORDS = frozenset({
    "driver.records.Task",
    "driver.records.Proposal",
    "driver.records.Rollout",
    "driver.collapse.WorkFlags",
    "driver.loop.Experience",
})

_PLAIN = (type(None), bool, int, float, str, bytes)


class CheckpointError(RuntimeError):
    """A missing, partial or corrupt checkpoint; the message names the file. `path`: that
    file; `reason`: the message without it."""

    def __init__(self, message: str, path: Path | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.path, self.reason = path, reason if reason is not None else message


class RefusedCheckpoint(CheckpointError):
    """A checkpoint file that holds more than tensors and plain data (a pickled object, a
    record type or tag not known here): not loaded, and no older checkpoint is tried."""


def _error(cls: type[CheckpointError], path: Path, reason: str) -> CheckpointError:
    return cls(f"{path}: {reason}", path, reason)


# ---- plain data ------------------------------------------------------------------------
def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _array(a: np.ndarray, where: str) -> dict:
    if a.dtype.hasobject:
        raise TypeError(f"{where}: cannot checkpoint a NumPy array of Python objects")
    raw = a.tobytes()  # C order, whatever the array's own
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": data}


def encode(value: Any, where: str = "state") -> Any:
    """`value` as tensors and plain data (see the module docstring); `where` names the place
    in a TypeError for a value that has no encoding."""
    memo: dict[int, int] = {}
    keep: list[Any] = []  # the records seen, alive until the walk ends (their ids stay theirs)

    def walk(x: Any, at: str) -> Any:
        t = type(x)
        if t in _PLAIN or t is torch.Tensor:
            return x
        if t is list:
            return [walk(v, f"{at}[{i}]") for i, v in enumerate(x)]
        if t is dict:
            if TAG not in x and all(type(k) in _PLAIN for k in x):
                return {k: walk(v, f"{at}[{k!r}]") for k, v in x.items()}
            return {TAG: "dict", "items": [[walk(k, f"{at}.key"), walk(v, f"{at}[{k!r}]")] for k, v in x.items()]}
        if t is tuple:
            return {TAG: "tuple", "items": [walk(v, f"{at}[{i}]") for i, v in enumerate(x)]}
        if t is set or t is frozenset:
            return {TAG: t.__name__, "items": [walk(v, f"{at}.item") for v in x]}
        if t is np.ndarray:
            return {TAG: "ndarray", **_array(x, at)}
        if isinstance(x, np.generic):
            return {TAG: "npscalar", **_array(np.asarray(x), at)}
        if dataclasses.is_dataclass(x) and _type_name(t) in RECORDS:
            if id(x) in memo:
                return {TAG: "ref", "id": memo[id(x)]}
            memo[id(x)] = len(keep)
            keep.append(x)
            fields = {f.name: walk(getattr(x, f.name), f"{at}.{f.name}") for f in dataclasses.fields(x)}
            return {TAG: "record", "type": _type_name(t), "id": memo[id(x)], "fields": fields}
        raise TypeError(f"{at}: cannot checkpoint a {_type_name(t)} (tensors, plain data and the records in "
                        f"driver.checkpoint.RECORDS only)")

    return walk(value, where)


class _Unknown(ValueError):
    pass


def _record_type(name: Any) -> type:
    if name not in RECORDS:
        raise _Unknown(f"record type {name!r} is not one a checkpoint holds")
    module, _, qualname = name.rpartition(".")
    cls = getattr(importlib.import_module(module), qualname, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise _Unknown(f"record type {name!r} is no longer defined")
    return cls


def _from_array(d: dict) -> np.ndarray:
    data = d["data"]
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise _Unknown("an array without its bytes")
    dtype = np.dtype(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None or dtype.hasobject:
        raise _Unknown(f"an array of dtype {d['dtype']!r}")
    return np.frombuffer(data.numpy().tobytes(), dtype=dtype).reshape(tuple(d["shape"])).copy()


def decode(value: Any) -> Any:
    """The inverse of `encode`; `_Unknown` (a ValueError) for a tag or record type it does not know."""
    records: dict[int, Any] = {}

    def walk(x: Any) -> Any:
        t = type(x)
        if t in _PLAIN or t is torch.Tensor:
            return x
        if t is list:
            return [walk(v) for v in x]
        if t is not dict:
            raise _Unknown(f"a {_type_name(t)}")
        if TAG not in x:
            return {k: walk(v) for k, v in x.items()}
        tag = x[TAG]
        if tag == "tuple":
            return tuple(walk(v) for v in x["items"])
        if tag == "set":
            return {walk(v) for v in x["items"]}
        if tag == "frozenset":
            return frozenset(walk(v) for v in x["items"])
        if tag == "dict":
            return {walk(k): walk(v) for k, v in x["items"]}
        if tag == "ndarray":
            return _from_array(x)
        if tag == "npscalar":
            return _from_array(x)[()]
        if tag == "ref":
            if x["id"] not in records:
                raise _Unknown(f"a reference to record {x['id']!r} before it")
            return records[x["id"]]
        if tag == "record":
            cls = _record_type(x["type"])
            saved = x["fields"]
            fields = {f.name: f for f in dataclasses.fields(cls)}
            unknown = sorted(set(saved) - set(fields))
            if unknown:
                raise _Unknown(f"{x['type']} has no field {', '.join(unknown)}")
            obj = cls.__new__(cls)  # as pickle does: fields set, __init__ not run
            for name, f in fields.items():
                if name in saved:
                    v = walk(saved[name])
                elif f.default is not dataclasses.MISSING:
                    v = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    v = f.default_factory()
                else:
                    raise _Unknown(f"{x['type']} without its field {name}")
                object.__setattr__(obj, name, v)
            records[x["id"]] = obj
            return obj
        raise _Unknown(f"the tag {tag!r}")

    return walk(value)


# ---- files -----------------------------------------------------------------------------
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _manifest_step(directory: Path) -> int | None:
    try:
        step = json.loads((directory / MANIFEST).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int else None


def _kept(root: Path, name: str) -> dict[int, Path]:
    """The older checkpoints beside `root/name`: step -> directory."""
    out = {}
    for p in root.glob(f"{name}.*"):
        suffix = p.name[len(name) + 1:]
        if suffix.isdigit() and p.is_dir():
            out[int(suffix)] = p
    return out


def save(directory: Path, step: int, parts: dict[str, Any], keep: int = 2) -> Path:
    """Write `parts` (name -> state: tensors, plain data, records) as checkpoint `directory`
    for `step`; the checkpoint it replaces is kept as `<directory>.<its step>`, and of those the
    newest `keep - 1` stay (checkpoints of `step` or later, from before the run went back to an
    earlier one, are dropped)."""
    directory = Path(directory)
    root, name = directory.parent, directory.name
    tmp, old = root / f"{name}.tmp", root / f"{name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for part, state in parts.items():
        buffer = io.BytesIO()
        torch.save(encode(state, part), buffer)
        data = buffer.getvalue()
        _write(tmp / f"{part}.pt", data)
        files[f"{part}.pt"] = {"sha256": _sha256(data), "bytes": len(data)}
    _write(tmp / MANIFEST, json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1).encode())
    _fsync_dir(tmp)
    if directory.exists():
        previous = _manifest_step(directory)
        if previous is not None and previous < step and keep > 1:
            shutil.rmtree(root / f"{name}.{previous}", ignore_errors=True)
            directory.rename(root / f"{name}.{previous}")
        else:  # not kept: unreadable, of this step or later, or keep == 1
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
    tmp.rename(directory)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    kept = sorted(_kept(root, name).items(), reverse=True)
    for i, (s, p) in enumerate([(s, p) for s, p in kept if s < step]):
        if i >= keep - 1:
            shutil.rmtree(p, ignore_errors=True)
    for s, p in kept:
        if s >= step:
            shutil.rmtree(p, ignore_errors=True)
    return directory


def candidates(run: Path, name: str = NAME) -> list[Path]:
    """The run's checkpoint directories, newest first: `checkpoint/`, the older ones kept
    beside it by step, and `checkpoint.old` (left by a swap cut short) by its step."""
    run = Path(run)
    found = [(float("inf"), 2, run / name)] if (run / name).is_dir() else []
    found += [(s, 0, p) for s, p in _kept(run, name).items()]
    if (run / f"{name}.old" / MANIFEST).is_file():
        found.append((_manifest_step(run / f"{name}.old") or -1, 1, run / f"{name}.old"))
    return [p for *_, p in sorted(found, key=lambda c: (c[0], c[1]), reverse=True)]


def find(run: Path) -> Path:
    """The newest checkpoint directory of a run with a manifest (`load_latest` also checks its files)."""
    for candidate in candidates(run):
        if (candidate / MANIFEST).is_file():
            return candidate
    raise CheckpointError(f"{Path(run) / NAME / MANIFEST}: no checkpoint in {run}")


def _refusal(e: Exception) -> str:
    """The line of torch's weights-only refusal that says what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("Weights only load failed", "Check the documentation",
                                                            "Please", "You can use"))] or lines or [type(e).__name__]
    line = re.sub(r"^WeightsUnpickler error: ", "", said[0])
    return re.split(r" was not an allowed| whose module|\. ", line)[0].rstrip(".")[:160]


def load(directory: Path) -> tuple[int, dict[str, Any]]:
    """(step, parts) from a checkpoint directory, every file verified against the manifest and
    read as tensors and plain data only."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        step, files, version = manifest["step"], manifest["files"], manifest.get("format", 1)
        if type(step) is not int or not isinstance(files, dict):
            raise TypeError("step or files of the wrong type")
    except FileNotFoundError:
        raise _error(CheckpointError, manifest_path, "missing (partial checkpoint?)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _error(CheckpointError, manifest_path, f"unreadable manifest ({e})") from None
    if version != FORMAT:
        raise _error(RefusedCheckpoint, manifest_path,
                     f"checkpoint format {version!r}, this version reads format {FORMAT} only (format 1 held "
                     "pickled objects, which are not loaded; format 2 held the run's table rows, which now "
                     "live in the run directory only)")
    parts = {}
    for filename, meta in files.items():
        path = directory / filename
        if Path(filename).name != filename or not filename.endswith(".pt"):
            raise _error(RefusedCheckpoint, manifest_path, f"names a file {filename!r} outside the checkpoint")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise _error(CheckpointError, path, "missing (partial checkpoint?)") from None
        try:
            intact = len(data) == meta["bytes"] and _sha256(data) == meta["sha256"]
        except (KeyError, TypeError):
            raise _error(CheckpointError, manifest_path, f"unreadable manifest (no checksum for {filename})") from None
        if not intact:
            raise _error(CheckpointError, path, "checksum mismatch (corrupt checkpoint)")
        try:
            state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise _error(RefusedCheckpoint, path, "refused: it holds a pickled object, not tensors and plain data "
                                                  f"({_refusal(e)})") from None
        except Exception as e:  # noqa: BLE001 - a file that matches its checksum but does not load
            raise _error(CheckpointError, path, f"unreadable ({type(e).__name__}: {_refusal(e)})") from None
        try:
            parts[filename[: -len(".pt")]] = decode(state)
        except (_Unknown, KeyError, TypeError, ValueError) as e:
            raise _error(RefusedCheckpoint, path, f"refused: it holds {e}, not a checkpoint's plain data") from None
    return step, parts


def _skipped(directory: Path, e: CheckpointError) -> str:
    step = _manifest_step(directory)
    which = f"checkpoint step {step}" if step is not None else f"checkpoint {directory.name}/"
    what = "incomplete" if "missing" in e.reason else "corrupt"
    where = e.path.name if e.path is not None else directory.name
    return f"{which} is {what} ({where}: {e.reason.removesuffix(' (corrupt checkpoint)')})"


def load_latest(run: Path, quiet: bool = False) -> tuple[int, dict[str, Any], Path]:
    """(step, parts, directory) of the newest intact checkpoint of `run`; a newer one that is
    corrupt or incomplete is skipped and said so (a warning, unless `quiet`). A refused file
    (`RefusedCheckpoint`) stops the search: nothing older is tried."""
    skipped = []
    for directory in candidates(run):
        try:
            step, parts = load(directory)
        except RefusedCheckpoint:
            raise
        except CheckpointError as e:
            skipped.append(_skipped(directory, e))
            continue
        if skipped and not quiet:
            log.warning("%s; resuming from step %d (%s)", "; ".join(skipped), step, directory)
        return step, parts, directory
    if skipped:
        raise CheckpointError(f"{Path(run)}: no intact checkpoint ({'; '.join(skipped)})", Path(run),
                              f"no intact checkpoint ({'; '.join(skipped)})")
    raise CheckpointError(f"{Path(run) / NAME / MANIFEST}: no checkpoint in {run}")
