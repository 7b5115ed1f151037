"""Experiment trackers (`logging.tensorboard`, `logging.wandb`): the metrics.parquet scalars, same names.

Each step, `Trackers.log(step, rows)` receives the rows that go to metrics.parquet (one per
member). Numeric columns become scalars under their column names (docs/design.md §4.4):

- TensorBoard: `runs/<name>/tensorboard/<member>/` per member, tags = column names, so one
  chart per metric overlays the members; the step-wide columns (`time/*`,
  `population/coverage`, the same in every row of a step) once, in `runs/<name>/tensorboard/`.
- Weights & Biases (optional extra `populora[wandb]`): one run under `runs/<name>/wandb/`,
  offline unless `logging.wandb_mode: online`; step-wide columns under their names, member
  columns as `<column>/<member>`; the x axis is the training step (`step`).

A step logged again (a resumed or recovered run replays the steps after its checkpoint)
purges TensorBoard's later events (`purge_step`); W&B keeps both copies at the same `step`.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from driver.config import Config

log = logging.getLogger(__name__)

STEP_WIDE = ("time/", "population/coverage")  # columns with one value per step, not per member


def is_step_wide(column: str) -> bool:
    return column.startswith(STEP_WIDE)


def scalars(row: dict) -> dict[str, float]:
    """The numeric columns of a metrics row (bools, strings, None and `step` left out)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def read_tensorboard(directory: Path) -> dict[tuple[str, str, int], float]:
    """(run, tag, step) -> value of a `tensorboard/` directory, read with TensorBoard's own event
    reader (which applies purges); run "" is the directory itself, the others its member folders."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for run in [directory] + sorted(p for p in directory.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every event
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                found[("" if run == directory else run.name, tag, event.step)] = event.value
    return found


class TensorBoardTracker:
    """Event files through torch.utils.tensorboard.SummaryWriter (needs the `tensorboard` package)."""

    def __init__(self, path: Path):
        from torch.utils.tensorboard import SummaryWriter  # raises without `tensorboard`

        self._writer_cls = SummaryWriter
        self.path = path
        self.writers: dict[str, object] = {}
        self.last_step = 0

    def _writer(self, run: str, step: int):
        if run not in self.writers:
            log_dir = self.path / run if run else self.path
            # events already there come from an earlier attempt at these steps: hide those >= step
            earlier = log_dir.is_dir() and any(p.name.startswith("events.") for p in log_dir.iterdir())
            self.writers[run] = self._writer_cls(str(log_dir), purge_step=step if earlier else None)
        return self.writers[run]

    def log(self, step: int, rows: list[dict]) -> None:
        if step <= self.last_step:  # replayed after a restore: reopen, purging the abandoned steps
            self.close()
        self.last_step = step
        wide: dict[str, float] = {}
        for row in rows:
            values = scalars(row)
            wide.update({k: v for k, v in values.items() if is_step_wide(k)})
            writer = self._writer(row["member"], step)
            for tag, value in values.items():
                if not is_step_wide(tag):
                    writer.add_scalar(tag, value, step)
        writer = self._writer("", step)
        for tag, value in wide.items():
            writer.add_scalar(tag, value, step)
        for writer in self.writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers = {}


class WandbTracker:
    """One W&B run; offline by default, so nothing leaves the machine unless asked."""

    def __init__(self, run_path: Path, name: str, project: str, mode: str, config: dict):
        if mode == "offline":
            # wandb reports its own crashes to Sentry unless told not to: offline means offline
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        try:
            import wandb
        except ImportError:
            raise ImportError("logging.wandb: needs the optional extra (pip install -e '.[wandb]')") from None
        (run_path / "wandb").mkdir(parents=True, exist_ok=True)  # wandb writes under <dir>/wandb/
        id_file = run_path / "wandb" / "run_id"  # a resumed run continues the same W&B run
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_path), mode=mode,
                              config=config, settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True,
                                                                     disable_git=True, disable_code=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, rows: list[dict]) -> None:
        record: dict[str, float] = {"step": step}
        for row in rows:
            for column, value in scalars(row).items():
                record[column if is_step_wide(column) else f"{column}/{row['member']}"] = value
        self.run.log(record)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # ends wandb's service process, which is when the offline file is complete


class Trackers:
    """The trackers a run's config asks for (none by default: then `log` does nothing)."""

    def __init__(self, trackers: list | None = None):
        self.trackers = trackers or []

    @classmethod
    def open(cls, cfg: Config, run_path: Path) -> Trackers:
        """Opens `logging.tensorboard` / `logging.wandb` for the run directory `run_path`."""
        trackers: list = []
        try:
            if cfg.logging.tensorboard:
                try:
                    trackers.append(TensorBoardTracker(run_path / "tensorboard"))
                except ImportError:
                    raise ImportError("logging.tensorboard: the `tensorboard` package is missing "
                                      "(pip install tensorboard)") from None
            if cfg.logging.wandb:
                trackers.append(WandbTracker(run_path, cfg.run.name, cfg.logging.wandb_project,
                                             cfg.logging.wandb_mode, cfg.to_dict()))
        except BaseException:
            cls(trackers).close()
            raise
        return cls(trackers)

    def log(self, step: int, rows: list[dict]) -> None:
        """Logs one step's metrics.parquet rows to every tracker."""
        for tracker in self.trackers:
            tracker.log(step, rows)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:  # a tracker failing at exit must not hide the run's own error
                log.warning("closing %s failed: %s", type(tracker).__name__, e)
        self.trackers = []
