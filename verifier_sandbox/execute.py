"""Host side of isolated execution: warm zygotes per hash seed, and `run_program`.

Hash randomisation is fixed when an interpreter starts, so determinism checks need
zygotes started with different PYTHONHASHSEEDs; each is started lazily, once, inside the
isolation layer, and forks a child per program (never a new interpreter per program).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from . import isolation, screening

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout", "memory", "forbidden", "output_limit")
VALIDATION_SEEDS = (1, 2)   # the two PYTHONHASHSEEDs a determinism check compares
MAX_TIMEOUT_S = 60.0
MIN_MEMORY_MB, MAX_MEMORY_MB = 64, 16384
_READY_TIMEOUT_S = 20.0
_REPLY_GRACE_S = 10.0       # the zygote enforces the timeout; this only catches a hung zygote


@dataclass(frozen=True)
class RunResult:
    """Outcome of one program run: status, repr of the call's value, captured output."""

    status: str
    result: str | None = None
    stdout: str = ""
    error: str | None = None

    def to_dict(self) -> dict:
        """The CLI JSON contract: every field that is not None."""
        return {k: v for k, v in asdict(self).items() if v is not None}


class ZygoteDied(RuntimeError):
    """The zygote process exited or stopped answering."""


class Zygote:
    """One warm sandboxed interpreter with a fixed hash seed, serving one request at a time."""

    def __init__(self, layer: str, hash_seed: int):
        self.spec = isolation.launch_spec(layer, hash_seed)
        self.hash_seed = hash_seed
        self._buffer = b""
        try:
            self.proc = subprocess.Popen(
                self.spec.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=self.spec.env, start_new_session=True, close_fds=True)
        except OSError:
            if self.spec.host_tmp:
                shutil.rmtree(self.spec.host_tmp, ignore_errors=True)
            raise
        try:
            self.info = self._read_line(_READY_TIMEOUT_S)
        except ZygoteDied:
            self.close()
            raise
        if not self.info.get("ready"):
            self.close()
            raise ZygoteDied(f"zygote did not start: {self.info}")

    def _read_line(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise ZygoteDied("zygote did not answer in time")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise ZygoteDied(f"zygote exited (code {self.proc.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, req: dict) -> dict:
        """Sends one run request and waits for its reply."""
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise ZygoteDied(f"zygote pipe closed: {exc}") from exc
        return self._read_line(float(req["timeout_s"]) + _REPLY_GRACE_S)

    def close(self) -> None:
        """Stops the zygote (and with it its namespace) and removes its host temp dir."""
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.spec.host_tmp:
            shutil.rmtree(self.spec.host_tmp, ignore_errors=True)


class ZygotePool:
    """Thread-safe pool of warm zygotes keyed by hash seed, started lazily, closed at exit."""

    def __init__(self, max_per_seed: int | None = None, layer: str | None = None):
        if layer is not None and layer not in isolation.LAYERS:
            raise ValueError(f"layer must be one of {isolation.LAYERS}, got {layer!r}")
        self.max_per_seed = max_per_seed or max(2, os.cpu_count() or 1)
        self._forced_layer = layer
        self._cond = threading.Condition()
        self._idle: dict[int, list[Zygote]] = {}
        self._live: dict[int, int] = {}
        self._all: set[Zygote] = set()
        self._layer: str | None = None
        self._owner_pid = os.getpid()
        # bubblewrap's --die-with-parent (PR_SET_PDEATHSIG) fires when the *thread* that
        # started it exits, so zygotes are started by these long-lived threads, never by a
        # caller's thread (a ThreadPoolExecutor of the caller ends; its zygotes would die).
        self._spawner: ThreadPoolExecutor | None = None

    @property
    def layer(self) -> str | None:
        """The isolation layer in use (bwrap, unshare or none); None before the first run."""
        return self._layer

    def _start(self, hash_seed: int) -> Zygote:
        with self._cond:
            if self._spawner is None:
                self._spawner = ThreadPoolExecutor(max(2, self.max_per_seed), thread_name_prefix="zygote-spawner")
            spawner = self._spawner
        return spawner.submit(self._start_here, hash_seed).result()

    def _start_here(self, hash_seed: int) -> Zygote:
        if self._layer is not None:
            return Zygote(self._layer, hash_seed)
        errors = []
        layers = [self._forced_layer] if self._forced_layer else isolation.candidate_layers()
        for layer in layers:
            try:
                zygote = Zygote(layer, hash_seed)
            except (ZygoteDied, OSError, ValueError) as exc:
                errors.append(f"{layer}: {exc}")
                continue
            self._layer = layer
            self._report_layer(zygote, errors)
            return zygote
        raise ZygoteDied("no isolation layer could start a zygote: " + "; ".join(errors))

    @staticmethod
    def _report_layer(zygote: Zygote, errors: list[str]) -> None:
        info = zygote.info
        if zygote.spec.layer == "none":
            log.warning("verifier sandbox: no bwrap/unshare usable (%s); running programs "
                        "without network/PID namespaces (degraded isolation)",
                        "; ".join(errors) or "forced")
        else:
            log.info("verifier sandbox: isolation layer %s", zygote.spec.layer)
        if not info.get("chroot"):
            log.warning("verifier sandbox: chroot unavailable; programs can read the "
                        "filesystem visible to the %s layer", zygote.spec.layer)
        if not info.get("uid_drop"):
            log.warning("verifier sandbox: cannot drop to a private uid; process limit "
                        "relies on the PID namespace and cleanup")

    def _acquire(self, hash_seed: int) -> Zygote:
        with self._cond:
            if os.getpid() != self._owner_pid:  # forked host: the zygotes belong to the parent
                self.__init__(self.max_per_seed, self._forced_layer)
            while True:
                idle = self._idle.setdefault(hash_seed, [])
                if idle:
                    return idle.pop()
                if self._live.get(hash_seed, 0) < self.max_per_seed:
                    self._live[hash_seed] = self._live.get(hash_seed, 0) + 1
                    break
                self._cond.wait()
        try:
            zygote = self._start(hash_seed)
        except BaseException:
            with self._cond:
                self._live[hash_seed] -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._all.add(zygote)
        return zygote

    def _release(self, zygote: Zygote, healthy: bool) -> None:
        with self._cond:
            if healthy:
                self._idle.setdefault(zygote.hash_seed, []).append(zygote)
            else:
                self._all.discard(zygote)
                self._live[zygote.hash_seed] -= 1
            self._cond.notify()
        if not healthy:
            zygote.close()

    def run(self, req: dict, hash_seed: int) -> dict:
        """Runs one request in a zygote with `hash_seed`, replacing dead zygotes on the way.

        Every idle zygote of the seed may have died at once (killed from outside), so up to
        `max_per_seed` dead ones are dropped before a freshly started one gets the request.
        """
        attempts = self.max_per_seed + 1
        for attempt in range(attempts):
            zygote = self._acquire(hash_seed)
            try:
                reply = zygote.request(req)
            except ZygoteDied as exc:
                self._release(zygote, healthy=False)
                log.warning("verifier sandbox: zygote (seed %s) died: %s", hash_seed, exc)
                if attempt == attempts - 1:
                    return {"status": "error", "error": f"sandbox failure: {exc}"}
                continue
            self._release(zygote, healthy=True)
            return reply
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Stops every zygote; later runs start fresh ones."""
        with self._cond:
            zygotes, self._all = list(self._all), set()
            self._idle, self._live = {}, {}
            spawner, self._spawner = self._spawner, None
            self._cond.notify_all()
        for zygote in zygotes:
            zygote.close()
        if spawner is not None:
            spawner.shutdown(wait=False)


POOL = ZygotePool()
atexit.register(POOL.close)


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(float(value), low), high)


def run_program(program: str, call: str = "f()", timeout_s: float = 5.0,
                memory_mb: int = 512, hash_seed: int | None = None,
                screen: bool = True) -> RunResult:
    """Runs `program` then evaluates `call` in an isolated process; never raises on bad code.

    `screen=False` skips static screening: only tests use it, to show that isolation holds
    on its own for hostile programs.
    """
    if not isinstance(program, str) or not isinstance(call, str):
        return RunResult("error", error="program and call must be strings")
    if screen:
        if screening.parse(program) is None:
            return RunResult("error", error="syntax error")
        call_tree = screening.parse(call, mode="eval")
        if call_tree is None:
            return RunResult("error", error="syntax error in call")
        reason = screening.screen(program) or screening.screen_tree(call_tree)
        if reason:
            return RunResult("forbidden", error=reason)
    req = {"program": program, "call": call,
           "timeout_s": _clamp(timeout_s, 0.01, MAX_TIMEOUT_S),
           "memory_mb": int(_clamp(memory_mb, MIN_MEMORY_MB, MAX_MEMORY_MB))}
    seed = VALIDATION_SEEDS[0] if hash_seed is None else int(hash_seed) % (2**32)
    try:
        reply = POOL.run(req, seed)
    except ZygoteDied as exc:
        return RunResult("error", error=str(exc))
    status = reply.get("status")
    if status not in STATUSES:
        return RunResult("error", error=f"bad sandbox reply: {reply!r}"[:300])
    return RunResult(status, reply.get("result"), reply.get("stdout") or "", reply.get("error"))
