"""VerifierPool: order, no lost work when a worker dies, elastic growth and shrink."""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray")

from actors.verifier import VerifierPool  # noqa: E402

SORT = "def f(a, b):\n    return sorted(a)[:b]"
# ~50-100 ms of pure Python per call, so a batch lasts long enough to kill a worker in it.
BUSY = "def f(n):\n    s = 0\n    for i in range(200000):\n        s += i % (n + 1)\n    return s"


@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, resources={"verifier": 4},
                 log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _busy_requests(n: int) -> list[dict]:
    # reject_trivial off: f(0) is 0, its own argument, and this test is about the pool, not the rules
    return [{"task_type": "code_o", "program": BUSY, "input": str(i), "reject_trivial": False} for i in range(n)]


def _expected_busy(i: int) -> str:
    return repr(sum(k % (i + 1) for k in range(200000)))


def test_results_in_request_order(ray_cluster):
    pool = VerifierPool(min_workers=2, max_workers=2, chunk_size=3, worker_cpus=0.5)
    try:
        requests = [{"task_type": "code_o", "program": SORT, "input": f"[{i}, {i - 5}, 7], 2"}
                    for i in range(20)]
        requests.append("not a dict")
        results = pool.validate(requests)
        assert len(results) == 21
        for i, result in enumerate(results[:20]):
            assert result == {"valid": True, "output": repr(sorted([i, i - 5, 7])[:2])}, i
        assert results[20]["valid"] is False and "error" in results[20]
        checks = pool.check([{"task_type": "code_o", "output": "[1, 2]", "answer": "[1, 2]"},
                             {"task_type": "code_o", "output": "[1, 2]", "answer": "[1,"}])
        assert checks == [{"correct": True}, {"correct": False, "reason": "malformed"}]
        assert pool.run([{"program": SORT, "call": "f([2, 1], 1)"}])[0]["result"] == "[1]"
    finally:
        pool.shutdown()


def test_worker_killed_mid_batch_loses_nothing(ray_cluster, caplog):
    pool = VerifierPool(min_workers=2, max_workers=2, chunk_size=1, worker_cpus=0.5)
    try:
        killed = []

        def kill_one():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                busy = [w for w in list(pool._workers.values()) if w.ready and w.inflight]
                if busy:
                    time.sleep(0.1)  # let it get into the chunk it is running
                    ray.kill(busy[0].handle, no_restart=True)
                    killed.append(busy[0].index)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_one)
        killer.start()
        with caplog.at_level("WARNING", logger="actors.verifier"):
            results = pool.validate(_busy_requests(16))
        killer.join()
        assert killed, "the test did not kill a worker"
        assert "lost mid-batch" in caplog.text
        assert [r.get("output") for r in results] == [_expected_busy(i) for i in range(16)]
        assert pool.size == 2
    finally:
        pool.shutdown()


def test_pool_grows_under_load_and_shrinks_after(ray_cluster):
    pool = VerifierPool(min_workers=2, max_workers=4, chunk_size=1, worker_cpus=0.5,
                        idle_shrink_s=0.0)
    try:
        assert pool.size == 2
        results = pool.validate(_busy_requests(12))
        assert all(r["valid"] for r in results)
        assert pool.peak_size == 4, f"expected growth to 4 workers, peak was {pool.peak_size}"
        assert pool.size == 2, f"expected shrink back to 2 workers, have {pool.size}"
    finally:
        pool.shutdown()


def test_pool_shrinks_after_idle_delay(ray_cluster):
    pool = VerifierPool(min_workers=2, max_workers=3, chunk_size=1, worker_cpus=0.5,
                        idle_shrink_s=0.2)
    try:
        pool.validate(_busy_requests(8))
        assert pool.peak_size == 3
        deadline = time.monotonic() + 10
        while pool.size > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.size == 2
    finally:
        pool.shutdown()


def test_min_workers_must_not_exceed_max():
    with pytest.raises(ValueError, match="min_workers"):
        VerifierPool(min_workers=3, max_workers=2)
