"""Isolated execution (execute.py, zygote.py, isolation.py), screening and complexity.

Hostile programs run with screen=False so that isolation, not screening, must contain
them; each runs under every isolation layer this machine can start.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import textwrap
import time
import uuid

import pytest

from verifier_sandbox import complexity, execute, run_program, screen
from verifier_sandbox.execute import ZygotePool
from verifier_sandbox.isolation import LAYERS

OK_PROGRAM = "def f(a, b):\n    return sorted(a)[:b]"


def _layers() -> list[str]:
    usable = []
    for layer in LAYERS:
        if layer != "none" and not shutil.which(layer):
            continue
        pool = ZygotePool(max_per_seed=1, layer=layer)
        try:
            pool.run({"program": "def f(): return 1", "call": "f()", "timeout_s": 5,
                      "memory_mb": 256}, 1)
            usable.append(layer)
        except execute.ZygoteDied:
            pass
        finally:
            pool.close()
    return usable


USABLE_LAYERS = _layers()


@pytest.fixture(scope="module", params=USABLE_LAYERS)
def layer(request):
    """Routes run_program through a pool forced onto one isolation layer."""
    pool = ZygotePool(layer=request.param)
    saved, execute.POOL = execute.POOL, pool
    yield request.param
    execute.POOL = saved
    pool.close()


def hostile(source: str, timeout_s: float = 1.0, memory_mb: int = 256) -> execute.RunResult:
    return run_program(textwrap.dedent(source), "f()", timeout_s=timeout_s,
                       memory_mb=memory_mb, screen=False)


def assert_still_serving() -> None:
    result = run_program(OK_PROGRAM, "f([3, 1, 2], 2)")
    assert result.status == "ok" and result.result == "[1, 2]", result


def _host_processes_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as handle:
                    fields = dict(line.split(":", 1) for line in handle if ":" in line)
            except OSError:
                continue
            # A zombie is dead already; only the host's init can still reap it.
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                pids.append(int(name))
    return pids


# -- plain behaviour --------------------------------------------------------------------

def test_run_returns_repr_and_stdout():
    result = run_program("def f(x):\n    print('hi', x)\n    return {'a': [x, 2.5]}", "f(1)")
    assert result == execute.RunResult("ok", "{'a': [1, 2.5]}", "hi 1\n", None)
    assert result.to_dict() == {"status": "ok", "result": "{'a': [1, 2.5]}", "stdout": "hi 1\n"}


def test_run_reports_errors_and_screening():
    assert run_program("def f():\n    return 1 / 0").error.startswith("ZeroDivisionError")
    assert run_program("def f(:\n").status == "error"
    forbidden = run_program("import os\ndef f():\n    return 1")
    assert forbidden.status == "forbidden" and "import os" in forbidden.error
    assert run_program(OK_PROGRAM, "f.__globals__").status == "forbidden"


def test_hash_seed_fixes_hash_randomisation():
    program = "def f():\n    return hash('populora')"
    one = run_program(program, hash_seed=1).result
    assert run_program(program, hash_seed=1).result == one
    assert run_program(program, hash_seed=2).result != one


def test_dead_zygote_is_restarted_transparently():
    assert_still_serving()
    for zygote in list(execute.POOL._all):
        os.killpg(zygote.proc.pid, 9)
    assert_still_serving()


# -- hostile programs, under every usable layer ------------------------------------------

def test_fork_bomb(layer):
    result = hostile("""
        import os
        def f():
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        """)
    assert result.status in ("timeout", "error"), result
    assert_still_serving()


def test_memory_bomb(layer):
    # a wall clock of 5 s, not 1: on a loaded machine the growing bomb's 26 page-faulting
    # chunks once took longer than 1 s to reach the limit (status "timeout")
    assert hostile("def f():\n    return bytearray(10**10)", timeout_s=5.0).status == "memory"
    grow = hostile("""
        def f():
            chunks = []
            while True:
                chunks.append(bytearray(10**7))
        """, timeout_s=5.0)
    assert grow.status == "memory", grow
    assert_still_serving()


def test_infinite_loop_and_ignored_sigterm(layer):
    assert hostile("def f():\n    while True:\n        pass", timeout_s=0.5).status == "timeout"
    games = hostile("""
        import signal
        def f():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
                signal.signal(sig, signal.SIG_IGN)
            while True:
                pass
        """, timeout_s=0.5)
    assert games.status == "timeout", games
    assert_still_serving()


def test_output_flood(layer):
    result = hostile("def f():\n    while True:\n        print('x' * 1000)")
    assert result.status == "output_limit", result.status
    assert len(result.stdout) <= 4096
    big = hostile("def f():\n    return 'y' * (5 * 1024 * 1024)")
    assert big.status == "output_limit"
    assert_still_serving()


def test_host_files_are_invisible(layer):
    secret = tempfile.NamedTemporaryFile("w", dir="/tmp", prefix="populora-secret-",
                                         delete=False)
    secret.write("top secret")
    secret.close()
    try:
        for path in ("/etc/passwd", secret.name, os.path.abspath(__file__),
                     os.path.expanduser("~/.bashrc")):
            result = hostile(f"def f():\n    return open({path!r}).read()")
            assert result.status == "error", (path, result)
            assert "secret" not in (result.result or "") and "root:" not in (result.result or "")
        listing = hostile("import os\ndef f():\n    return os.listdir('/')")
        assert listing.status == "ok" and listing.result == "[]", listing
    finally:
        os.unlink(secret.name)
    assert_still_serving()


def test_writes_outside_the_work_dir_do_not_reach_the_host(layer):
    targets = [f"/tmp/populora-pwned-{uuid.uuid4().hex}",
               os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            f"pwned-{uuid.uuid4().hex}")]
    for target in targets:
        result = hostile(f"""
            import os
            def f():
                with open({target!r}, 'w') as handle:
                    handle.write('pwned')
                os.system('touch {target}')
                return 1
            """)
        assert result.status in ("error", "ok"), result
        assert not os.path.exists(target), target
    local = hostile("def f():\n    open('scratch.txt', 'w').write('ok')\n"
                    "    return open('scratch.txt').read()")
    assert local.status == "ok" and local.result == "'ok'", local
    assert_still_serving()


def test_os_system_and_ctypes(layer):
    system = hostile("import os\ndef f():\n    return os.system('echo shell-ran')")
    assert "shell-ran" not in system.stdout
    assert system.status == "error" or system.result != "0", system
    ctypes = hostile("import ctypes\ndef f():\n    return ctypes.CDLL(None).getpid()")
    assert ctypes.status == "error", ctypes
    assert_still_serving()


def test_no_network(layer):
    if layer == "none":
        pytest.skip("the degraded 'none' layer has no network namespace")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        result = hostile(f"""
            import socket
            def f():
                s = socket.create_connection(('127.0.0.1', {port}), timeout=1)
                return 'connected'
            """)
        assert result.status == "error", result
    finally:
        server.close()
    assert_still_serving()


def test_deep_recursion(layer):
    plain = hostile("def f(n=0):\n    return f(n + 1)")
    assert plain.status == "error" and "RecursionError" in plain.error
    crash = hostile("import sys\nsys.setrecursionlimit(10**7)\n"
                    "def f(n=0):\n    return f(n + 1)")
    assert crash.status in ("error", "memory", "timeout"), crash
    assert_still_serving()


def test_daemonised_child_is_killed(layer):
    result = hostile("""
        import os, time
        def f():
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(60)
                os._exit(0)
            return os.getuid()
        """)
    assert result.status == "ok", result
    uid = int(result.result)
    if uid != os.getuid():  # programs run under a uid of their own: find leftovers by it
        assert _host_processes_of_uid(uid) == []
    assert_still_serving()


def test_clean_environment(layer):
    os.environ["POPULORA_TEST_SECRET"] = "hunter2"
    try:
        result = hostile("import os\ndef f():\n    return dict(os.environ)")
    finally:
        del os.environ["POPULORA_TEST_SECRET"]
    assert result.status == "ok" and "hunter2" not in result.result


# -- screening and complexity -------------------------------------------------------------

@pytest.mark.parametrize("program, needle", [
    ("import os", "import os"),
    ("from subprocess import run", "import subprocess"),
    ("import numpy", "import numpy"),
    ("def f():\n    return eval('1')", "eval"),
    ("def f():\n    return open('x')", "open"),
    ("def f():\n    return ().__class__.__subclasses__()", "attribute __"),
    ("def f():\n    return getattr(f, 'x')", "getattr"),
    ("def f():\n    return __builtins__", "__builtins__"),
    ("from . import x", "relative"),
])
def test_screen_rejects(program, needle):
    reason = screen(program)
    assert reason is not None and reason.startswith("forbidden") and needle in reason, reason


def test_screen_accepts_allowed_programs():
    program = textwrap.dedent("""
        import math, itertools
        from collections import Counter
        class Box:
            def __init__(self, x):
                self.x = x
        def f(xs):
            return sorted(Counter(math.floor(x) for x in xs).items())
        if __name__ == "__main__":
            pass
        """)
    assert screen(program) is None
    assert screen("def f(:") == "syntax error"


def test_complexity():
    measures = complexity("def f(xs):\n    # note\n    total = 0\n    for x in xs:\n"
                          "        if x > 0 and x < 9:\n            total += x\n    return total")
    assert measures == {"ast_depth": measures["ast_depth"], "cyclomatic": 4, "loc": 6,
                        "n_variables": 3, "n_nodes": measures["n_nodes"]}
    assert measures["ast_depth"] >= 5 and measures["n_nodes"] > 10
    assert complexity("def f(:") == dict.fromkeys(measures, 0)


def test_ast_hash_abstracts_names_and_constants_but_not_structure():
    from verifier_sandbox import ast_hash

    base = ast_hash("def f(xs, k):\n    return sorted(xs)[:k]")
    assert len(base) == 16
    assert ast_hash("def f(a, b):  # renamed\n\n    return sorted(a)[:b]") == base
    assert ast_hash("def f(a, b):\n    return sorted(b)[:a]") != base, "data flow must count"
    assert ast_hash("def f(a, b):\n    return reversed(a)[:b]") != base, "builtins are operations"
    assert ast_hash("def f(x):\n    return x + 1") == ast_hash("def f(y):\n    return y + 7")
    assert ast_hash("def f(x):\n    return x + 1") != ast_hash("def f(x):\n    return x + 'a'")
    assert ast_hash("def f(x):\n    return x.append(1)") != ast_hash("def f(x):\n    return x.pop(1)")
    assert ast_hash("def f(:") is None and ast_hash(None) is None
    assert ast_hash("x = " + "(" * 90 + "1" + ")" * 90) is not None


def test_all_idle_zygotes_dead_at_once_are_replaced():
    """Several warm zygotes of one seed killed together: the next run still succeeds."""
    import threading

    busy = "def f():\n    total = 0\n    for i in range(2_000_000):\n        total += i\n    return total"
    threads = [threading.Thread(target=run_program, args=(busy,)) for _ in range(3)]  # overlap: several zygotes
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for zygote in list(execute.POOL._all):
        os.killpg(zygote.proc.pid, 9)
    assert_still_serving()


@pytest.mark.parametrize("layer", USABLE_LAYERS)
def test_zygotes_started_by_a_thread_that_ended_keep_serving(layer, caplog):
    """bubblewrap's --die-with-parent fires when the *thread* that started it exits: a zygote
    started from a worker thread (a ThreadPoolExecutor that finished) must not die with it."""
    import threading

    pool = ZygotePool(max_per_seed=1, layer=layer)
    req = {"program": "def f(): return 7", "call": "f()", "timeout_s": 5, "memory_mb": 256}
    try:
        worker = threading.Thread(target=pool.run, args=(req, 1))
        worker.start()
        worker.join()
        time.sleep(0.5)  # the kernel's parent-death signal would have arrived by now
        with caplog.at_level("WARNING", logger="verifier_sandbox.execute"):
            assert pool.run(req, 1)["result"] == "7"
        assert "died" not in caplog.text
    finally:
        pool.close()


def test_parsing_in_many_threads_at_once_is_safe():
    """CPython 3.11's AST constructor counts recursion per interpreter: a thread switch inside
    one thread's parse (here forced by collections running a Python finalizer) while another
    thread parses raised "SystemError: AST constructor recursion depth mismatch" (it broke
    `populora eval`'s CodeI/O loader). Without the lock this test failed in 5 of 5 runs here."""
    import gc
    import sys
    import threading

    from verifier_sandbox.screening import literal, parse

    class Cyclic:
        def __init__(self):
            self.me = self

        def __del__(self):
            sum(range(200))  # Python code in a collection: a chance to switch threads

    source = "\n".join(f"def g{i}(x):\n    return [x + {i} for _ in range(3)]" for i in range(200))
    errors = []

    def work():
        for _ in range(300):
            for _ in range(50):
                Cyclic()
            try:
                assert parse(source) is not None and literal("[1, (2, 3), {'a': None}]")[0] == 1
            except SystemError as exc:
                errors.append(str(exc))

    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(10)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    assert errors == []
