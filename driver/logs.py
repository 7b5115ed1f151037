"""Structured job logs: every record carries the training step and phase it happened in."""

from __future__ import annotations

import logging

_position = {"step": 0, "phase": "setup"}

FORMAT = "%(asctime)s %(levelname)s step=%(step)s phase=%(phase)s %(name)s: %(message)s"


def set_position(step: int | None = None, phase: str | None = None) -> None:
    if step is not None:
        _position["step"] = step
    if phase is not None:
        _position["phase"] = phase


class PositionFilter(logging.Filter):
    """Adds `step` and `phase` attributes to every record (for FORMAT)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.step = _position["step"]
        record.phase = _position["phase"]
        return True


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(PositionFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
