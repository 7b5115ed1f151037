"""Ray gauges that stay on the Prometheus endpoint while their owner lives.

Ray 2.60 exports a `ray.util.metrics.Gauge` value in the export that follows `set()`
(every ~10 s), and the node's Prometheus endpoint drops a series that was not set again
for ~20 s (measured: a gauge set once is visible from ~10 s to ~30 s after). A training
step takes minutes, so a gauge set once per step would be missing most of the time, and
Prometheus would scrape holes. A `HeldGauge` keeps its last value per tag set and a
daemon thread sets them again every `REFRESH_S`; it stops when the gauge is garbage
(a WeakSet), so a finished run's series leave the endpoint ~20 s after it ends.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

log = logging.getLogger(__name__)

REFRESH_S = 5.0  # well inside the ~20 s a set value stays exported

_held: weakref.WeakSet[HeldGauge] = weakref.WeakSet()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def _refresh_all() -> None:
    with _lock:
        gauges = list(_held)
    for gauge in gauges:
        gauge.refresh()


def _refresh_forever() -> None:
    while True:  # no reference to a gauge is kept while sleeping: garbage ones leave the WeakSet
        time.sleep(REFRESH_S)
        _refresh_all()


class HeldGauge:
    """A `ray.util.metrics.Gauge` whose last value per tag set keeps being exported."""

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()):
        from ray.util.metrics import Gauge

        global _thread
        self.name = name
        self.gauge = Gauge(name, description=description, tag_keys=tag_keys)
        self.values: dict[tuple[tuple[str, str], ...], float] = {}
        with _lock:
            _held.add(self)
            if _thread is None:
                _thread = threading.Thread(target=_refresh_forever, name="held-gauges", daemon=True)
                _thread.start()

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        self.values[key] = float(value)
        self.gauge.set(float(value), tags=tags or None)

    def clear(self) -> None:
        """Stops exporting every tag set (e.g. members that left); the series expire."""
        self.values = {}

    def refresh(self) -> None:
        for key, value in list(self.values.items()):
            try:
                self.gauge.set(value, tags=dict(key) or None)
            except Exception as e:  # metrics are observability, never a reason to fail
                log.debug("refreshing %s failed: %s", self.name, e)
