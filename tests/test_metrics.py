"""A HeldGauge set once stays on the node's Prometheus endpoint (a plain Ray gauge leaves it after ~20 s)."""

from __future__ import annotations

import gc
import time
import urllib.request

HOLD_S = 35.0  # past the ~30 s after which Ray 2.60's endpoint has dropped a gauge set once


def _series(port: int, name: str) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [line for line in text.splitlines() if line.startswith(f"ray_{name}{{")]


def test_a_held_gauge_stays_exported_until_it_is_garbage(ray_session):
    from actors import metrics

    port = ray_session.nodes()[0]["MetricsExportPort"]
    held = metrics.HeldGauge("populora_test_held", description="test", tag_keys=("member",))
    held.set(3.5, tags={"member": "a"})
    start = time.monotonic()
    timeline = []
    while time.monotonic() - start < HOLD_S:
        timeline.append((round(time.monotonic() - start), bool(_series(port, "populora_test_held"))))
        time.sleep(2.0)
    lines = _series(port, "populora_test_held")
    assert any('member="a"' in line and line.endswith(" 3.5") for line in lines), \
        f"expected the held value {HOLD_S:.0f} s after one set(), timeline (s, exported): {timeline}"

    del held
    gc.collect()
    assert not any(g.name == "populora_test_held" for g in list(metrics._held)), "a garbage gauge is still refreshed"
