"""Verifier actors: `VerifierWorker` (a thin Ray shell over verifier_sandbox.handle) and
`VerifierPool`, a driver-side elastic scheduler over those workers.

The pool splits requests into chunks, keeps each ready worker fed with up to
`inflight_per_worker` chunks, grows toward `max_workers` while chunks wait, shrinks back
to `min_workers` once idle, and re-queues the chunks of a worker that dies: a chunk's
result is stored once, by its index, so nothing is lost and nothing is counted twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import ray
from ray.exceptions import RayActorError

import verifier_sandbox
from verifier_sandbox.protocol import Request, as_request

log = logging.getLogger(__name__)

try:  # ActorUnavailableError exists in newer Ray only
    from ray.exceptions import ActorUnavailableError
except ImportError:  # pragma: no cover - older Ray
    ActorUnavailableError = RayActorError
try:
    from ray.exceptions import ActorDiedError
except ImportError:  # pragma: no cover - older Ray
    ActorDiedError = RayActorError

WORKER_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


@ray.remote(num_cpus=1, resources={"verifier": 1}, max_restarts=-1, max_task_retries=0)
class VerifierWorker:
    """Serves batches of verifier requests; the sandboxed work happens in forked processes."""

    def handle_batch(self, op: str, requests: list[dict]) -> list[dict]:
        """Answers each request with verifier_sandbox.handle, in order."""
        return [verifier_sandbox.handle(op, request) for request in requests]

    def ping(self) -> str:
        """Liveness probe; also tells the pool that the actor has started."""
        return "ok"


# the pool's Ray metrics (exported as ray_<name>; grafana/populora-dashboard.json reads them)
POOL_GAUGES = {"populora_verifier_pool_size": "VerifierWorker actors in the pool",
               "populora_verifier_queue_depth": "verifier chunks waiting for a worker"}


class _Gauges:
    """Pool size and queue depth as Ray metrics (no-op where metrics are unavailable)."""

    def __init__(self):
        try:
            from actors.metrics import HeldGauge

            self.size, self.queue = (HeldGauge(name, description=desc) for name, desc in POOL_GAUGES.items())
        except Exception:  # metrics are observability, never a reason to fail
            self.size = self.queue = None

    def set(self, size: int, queue_depth: int) -> None:
        for gauge, value in ((self.size, size), (self.queue, queue_depth)):
            if gauge is not None:
                try:
                    gauge.set(value)
                except Exception:
                    pass


class _Worker:
    def __init__(self, index: int, handle):
        self.index = index
        self.handle = handle
        self.ready_ref = handle.ping.remote()
        self.ready = False
        self.inflight = 0


class VerifierPool:
    """Elastic pool of VerifierWorker actors, owned by the driver (a plain object, not an actor)."""

    def __init__(self, min_workers: int = 2, max_workers: int = 4, chunk_size: int = 8,
                 timeout_s: float = 5.0, memory_mb: int = 512, worker_cpus: float = 1.0,
                 inflight_per_worker: int = 2, idle_shrink_s: float = 30.0,
                 start_timeout_s: float = 120.0):
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {min_workers}, "
                             f"{max_workers}")
        self.min_workers, self.max_workers = min_workers, max_workers
        self.chunk_size = max(1, chunk_size)
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.worker_cpus = worker_cpus
        self.inflight_per_worker = max(1, inflight_per_worker)
        self.idle_shrink_s = idle_shrink_s
        self.start_timeout_s = start_timeout_s
        self.peak_size = 0
        self._workers: dict[int, _Worker] = {}
        self._lock = threading.Lock()   # one batch at a time; the timer shrinks only when idle
        self._shrink_timer: threading.Timer | None = None
        self._gauges = _Gauges()
        self._closed = False
        for _ in range(min_workers):
            self._add_worker()
        self._gauges.set(self.size, 0)

    @property
    def size(self) -> int:
        """Number of live worker actors (started or starting)."""
        return len(self._workers)

    def run(self, requests: list[dict]) -> list[dict]:
        """`run` requests (CLI JSON dicts) -> results, in request order."""
        return self._map("run", requests)

    def validate(self, requests: list[Request | dict]) -> list[dict]:
        """`validate` requests -> results, in request order."""
        return self._map("validate", [as_request(r) for r in requests])

    def check(self, requests: list[Request | dict]) -> list[dict]:
        """`check` requests -> results, in request order."""
        return self._map("check", [as_request(r) for r in requests])

    def shutdown(self) -> None:
        """Kills every worker; the pool cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._cancel_shrink()
            for worker in list(self._workers.values()):
                self._remove_worker(worker)
            self._gauges.set(0, 0)

    # -- scheduling -------------------------------------------------------------------

    def _with_limits(self, request: dict) -> dict:
        if not isinstance(request, dict):
            return request
        return {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb, **request}

    def _map(self, op: str, requests: list[dict]) -> list[dict]:
        requests = [self._with_limits(r) for r in requests]
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is shut down")
            self._cancel_shrink()
            try:
                return self._schedule(op, requests)
            finally:
                self._after_batch()

    def _schedule(self, op: str, requests: list[dict]) -> list[dict]:
        starts = range(0, len(requests), self.chunk_size)
        chunks = [requests[s:s + self.chunk_size] for s in starts]
        results: list[list[dict] | None] = [None] * len(chunks)
        pending = deque(range(len(chunks)))
        inflight: dict[ray.ObjectRef, tuple[int, _Worker]] = {}
        last_progress = time.monotonic()
        while pending or inflight:
            self._grow(len(pending))
            self._assign(op, chunks, pending, inflight)
            self._gauges.set(self.size, len(pending))
            if inflight:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > self.start_timeout_s:
                raise RuntimeError(f"no VerifierWorker started within {self.start_timeout_s}s "
                                   "(is the 'verifier' resource available?)")
            waiting = list(inflight) + [w.ready_ref for w in self._workers.values()
                                        if not w.ready]
            if not waiting:
                raise RuntimeError("VerifierPool has no worker to run on")
            done, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in done:
                if ref in inflight:
                    self._collect(ref, inflight, results, pending)
                else:
                    self._mark_ready(ref)
        return [reply for chunk in results for reply in chunk]

    def _assign(self, op, chunks, pending, inflight) -> None:
        for worker in sorted(self._workers.values(), key=lambda w: w.inflight):
            while pending and worker.ready and worker.inflight < self.inflight_per_worker:
                index = pending.popleft()
                ref = worker.handle.handle_batch.remote(op, chunks[index])
                inflight[ref] = (index, worker)
                worker.inflight += 1

    def _collect(self, ref, inflight, results, pending) -> None:
        index, worker = inflight.pop(ref)
        worker.inflight -= 1
        try:
            replies = ray.get(ref)
        except WORKER_LOST as exc:
            log.warning("VerifierWorker-%d lost mid-batch (%s); re-queueing its chunks",
                        worker.index, type(exc).__name__)
            pending.appendleft(index)
            self._drop_worker(worker, inflight, pending)
            return
        if results[index] is None:  # a chunk is counted once, whichever copy lands first
            results[index] = replies

    def _mark_ready(self, ref) -> None:
        for worker in list(self._workers.values()):
            if worker.ready_ref == ref:
                try:
                    ray.get(ref)
                    worker.ready = True
                except WORKER_LOST:
                    self._remove_worker(worker)

    def _drop_worker(self, worker: _Worker, inflight, pending) -> None:
        for ref, (index, owner) in list(inflight.items()):
            if owner is worker:  # its other chunks will fail too: re-queue them now
                del inflight[ref]
                pending.appendleft(index)
        self._remove_worker(worker)
        while self.size < self.min_workers:
            self._add_worker()

    def _grow(self, queued: int) -> None:
        capacity = sum(self.inflight_per_worker - w.inflight for w in self._workers.values())
        want = queued - max(capacity, 0)
        while want > 0 and self.size < self.max_workers:
            self._add_worker()
            want -= self.inflight_per_worker
        while self.size < self.min_workers:
            self._add_worker()

    # -- workers ----------------------------------------------------------------------

    def _add_worker(self) -> None:
        index = 0
        while True:
            name = f"VerifierWorker-{index}"
            if index in self._workers or self._name_taken(name):
                index += 1
                continue
            try:
                handle = VerifierWorker.options(name=name, num_cpus=self.worker_cpus).remote()
            except ValueError:  # taken between the check and the create: next index
                index += 1
                continue
            self._workers[index] = _Worker(index, handle)
            self.peak_size = max(self.peak_size, self.size)
            return

    @staticmethod
    def _name_taken(name: str) -> bool:
        try:
            ray.get_actor(name)
            return True
        except ValueError:
            return False

    def _remove_worker(self, worker: _Worker) -> None:
        self._workers.pop(worker.index, None)
        try:
            ray.kill(worker.handle, no_restart=True)
        except Exception:  # already gone
            pass

    # -- elasticity -------------------------------------------------------------------

    def _shrink(self) -> None:
        """Kills idle workers above min_workers (highest index first)."""
        for index in sorted(self._workers, reverse=True):
            if self.size <= self.min_workers:
                break
            if self._workers[index].inflight == 0:
                self._remove_worker(self._workers[index])
        self._gauges.set(self.size, 0)

    def _after_batch(self) -> None:
        if self.idle_shrink_s <= 0:
            self._shrink()
            return
        self._shrink_timer = threading.Timer(self.idle_shrink_s, self._shrink_if_idle)
        self._shrink_timer.daemon = True
        self._shrink_timer.start()

    def _shrink_if_idle(self) -> None:
        if self._lock.acquire(blocking=False):  # a batch is running: not idle
            try:
                if not self._closed:
                    self._shrink()
            finally:
                self._lock.release()

    def _cancel_shrink(self) -> None:
        if self._shrink_timer is not None:
            self._shrink_timer.cancel()
            self._shrink_timer = None

