"""The zygote: a warm interpreter inside the isolation layer that forks one child per program.

This file is self-contained (standard library only, no package imports): the host passes
its source with `python -c`, so the sandbox never needs to see the project checkout.
Protocol: one JSON object per line on stdin (a request), one per line on stdout (a reply);
the first reply is a ready line describing what isolation the zygote could apply.

Per program the child: gets its own session and process group, a fresh working directory
that becomes its root (chroot, when permitted), rlimits (address space, CPU, file size,
open files, processes), and an unprivileged uid of its own when the zygote is root (so
RLIMIT_NPROC binds and every process it leaves behind can be found and killed).
"""

import builtins
import gc
import json
import os
import resource
import select
import shutil
import signal
import sys
import time

STDOUT_CAP = 256 * 1024     # bytes of stdout+stderr kept; more -> status output_limit
RESULT_CAP = 1024 * 1024    # bytes of the result repr; more -> status output_limit
FILE_SIZE_CAP = 8 * 1024 * 1024
OPEN_FILES_CAP = 32
PROCESS_CAP = 32            # per program; binds because each program has its own uid
EXIT_MEMORY = 86            # the child ran out of memory even while reporting it
UID_BASE = 200_000          # unprivileged uids handed to programs: UID_BASE + random


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _random_uid():
    # A fresh uid per program: kill(-1) from that uid reaches exactly this program's
    # processes, and RLIMIT_NPROC counts only them.
    return UID_BASE + int.from_bytes(os.urandom(3), "little")


def _enter_jail(workdir, uid, use_chroot):
    if use_chroot:
        os.chroot(workdir)
        os.chdir("/")
    else:
        os.chdir(workdir)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _probe(tmp_base, want_uid):
    """Forks a throwaway child to learn whether chroot and the uid drop work here."""
    results = {}
    for name, use_chroot, uid in (("chroot", True, None), ("uid_drop", False, _random_uid())):
        if name == "uid_drop" and not want_uid:
            results[name] = False
            continue
        workdir = os.path.join(tmp_base, "probe-" + os.urandom(6).hex())
        os.mkdir(workdir, 0o700)
        if uid is not None:
            try:
                os.chown(workdir, uid, uid)
            except OSError:
                pass
        pid = os.fork()
        if pid == 0:
            try:
                _enter_jail(workdir, uid, use_chroot)
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        results[name] = os.waitstatus_to_exitcode(status) == 0
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _run_child(req, workdir, uid, use_chroot, out_w, res_w, devnull):
    """Runs in the forked child; never returns."""
    code = 0
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.dup2(res_w, 3)
        os.closerange(4, 65536)
        memory = int(req.get("memory_mb", 512)) * 1024 * 1024
        cpu = int(float(req.get("timeout_s", 5.0))) + 1
        limits = [(resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                  (resource.RLIMIT_FSIZE, FILE_SIZE_CAP), (resource.RLIMIT_NOFILE, OPEN_FILES_CAP),
                  (resource.RLIMIT_CORE, 0)]
        if uid is not None:
            limits.append((resource.RLIMIT_NPROC, PROCESS_CAP))
        for which, value in limits:
            resource.setrlimit(which, (value, value))
        _enter_jail(workdir, uid, use_chroot)
        sys.stdout = open(1, "w", closefd=False, encoding="utf-8", errors="backslashreplace")
        sys.stderr = open(2, "w", closefd=False, encoding="utf-8", errors="backslashreplace")
        sys.stdin = open(0, "r", closefd=False)
    except BaseException as exc:  # the jail could not be entered: refuse to run at all
        try:
            reply = {"status": "error", "error": f"sandbox setup failed: {exc!r}"[:300]}
            _write_all(3, json.dumps(reply).encode())
        finally:
            os._exit(2)
    me = os.getpid()
    try:
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        # exec/eval of the text, not compile(): in a fresh fork compile() costs ~1.5 ms more.
        exec(req["program"], namespace)
        value = eval(req.get("call", "f()"), namespace)
        reply = {"status": "ok", "result": repr(value)}
    except MemoryError:
        reply = {"status": "memory", "error": "MemoryError"}
    except BaseException as exc:  # any failure of untrusted code is a result, not a crash
        try:
            reply = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
        except BaseException:
            reply = {"status": "error", "error": type(exc).__name__}
    if os.getpid() != me:  # a process the program forked: only the original reports
        os._exit(0)
    try:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        _write_all(3, json.dumps(reply).encode())
    except MemoryError:
        code = EXIT_MEMORY
    except BaseException:
        code = 1
    os._exit(code)


def _become_subreaper():
    # Without a PID namespace, orphans of killed programs would go to the host's init
    # (which may never reap them); as a subreaper the zygote reaps them itself.
    loaded = set(sys.modules)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError, ImportError):
        pass
    # Forget ctypes again: forked programs must not find it already imported.
    for name in set(sys.modules) - loaded:
        del sys.modules[name]


class Zygote:
    def __init__(self, config):
        self.tmp_base = config["tmp_base"]
        self.pid_ns = bool(config.get("pid_ns"))
        os.makedirs(self.tmp_base, exist_ok=True)
        self.devnull = os.open(os.devnull, os.O_RDWR)
        probe = _probe(self.tmp_base, os.geteuid() == 0)
        self.use_chroot = probe["chroot"]
        self.drop_uid = probe["uid_drop"]
        self.keep = {os.getpid(), os.getppid(), 1}
        if not self.pid_ns:
            _become_subreaper()
        self.spare = None

    def info(self):
        return {"ready": True, "pid": os.getpid(), "chroot": self.use_chroot,
                "uid_drop": self.drop_uid, "pid_ns": self.pid_ns,
                "hash_seed": os.environ.get("PYTHONHASHSEED")}

    def _workdir(self, uid):
        # An empty directory left by the previous program is reused (saves mkdir+rmtree);
        # its owner and mode are reset because the previous program owned it.
        workdir, self.spare = self.spare, None
        if workdir is None:
            workdir = os.path.join(self.tmp_base, "run-" + os.urandom(8).hex())
            os.mkdir(workdir, 0o700)
        os.chmod(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        return workdir

    def _recycle(self, workdir):
        try:
            if not os.listdir(workdir):
                self.spare = workdir
                return
        except OSError:
            pass
        shutil.rmtree(workdir, ignore_errors=True)

    def run(self, req):
        uid = _random_uid() if self.drop_uid else None
        workdir = self._workdir(uid)
        out_r, out_w = os.pipe()
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _run_child(req, workdir, uid, self.use_chroot, out_w, res_w, self.devnull)
        os.close(out_w)
        os.close(res_w)
        try:
            return self._supervise(pid, uid, out_r, res_r, float(req.get("timeout_s", 5.0)))
        finally:
            os.close(out_r)
            os.close(res_r)
            self._recycle(workdir)

    def _supervise(self, pid, uid, out_r, res_r, timeout_s):
        deadline = time.monotonic() + timeout_s
        out, res = bytearray(), bytearray()
        pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        watch = [out_r, res_r] + ([pidfd] if pidfd is not None else [])
        timed_out = over = exited = False
        status = None
        try:
            while not (exited or over):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                ready, _, _ = select.select(watch, [], [], remaining if pidfd is not None
                                            else min(remaining, 0.005))
                if pidfd is None:
                    done, wait_status = os.waitpid(pid, os.WNOHANG)
                    if done == pid:
                        exited, status = True, wait_status
                for fd in ready:
                    if fd == pidfd:
                        exited = True
                        continue
                    data = os.read(fd, 65536)
                    if not data:
                        watch.remove(fd)
                    buffer = out if fd == out_r else res
                    buffer += data
                    over = over or len(out) > STDOUT_CAP or len(res) > RESULT_CAP
        finally:
            if pidfd is not None:
                os.close(pidfd)
        status = self._kill_all(pid, uid, status)
        if not over:
            for fd, buffer in ((out_r, out), (res_r, res)):
                buffer += self._drain(fd)
            over = len(out) > STDOUT_CAP or len(res) > RESULT_CAP
        stdout = bytes(out[:STDOUT_CAP]).decode("utf-8", "replace")
        if over:  # a short excerpt is enough to see what flooded the output
            return {"status": "output_limit", "stdout": stdout[:1024],
                    "error": "output exceeded the limit"}
        if timed_out:
            return {"status": "timeout", "stdout": stdout, "error": "wall-clock timeout"}
        try:
            reply = json.loads(bytes(res).decode("utf-8")) if res else None
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or reply.get("status") not in (
                "ok", "error", "memory"):
            reply = self._status_without_result(status)
        reply["stdout"] = stdout
        return reply

    @staticmethod
    def _status_without_result(status):
        if status is None:
            return {"status": "error", "error": "exited without a result"}
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGXCPU:
                return {"status": "timeout", "error": "CPU time limit"}
            if sig == signal.SIGKILL:
                return {"status": "memory", "error": "killed (out of memory)"}
            return {"status": "error", "error": f"crashed: {signal.Signals(sig).name}"}
        code = os.WEXITSTATUS(status)
        if code == EXIT_MEMORY:
            return {"status": "memory", "error": "MemoryError"}
        return {"status": "error", "error": f"exited without a result (code {code})"}

    @staticmethod
    def _drain(fd):
        os.set_blocking(fd, False)
        data = bytearray()
        while len(data) <= RESULT_CAP + STDOUT_CAP:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return data

    def _kill_all(self, pid, uid, status):
        """Kills the program and everything it spawned; returns the child's wait status."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if status is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                status = os.waitpid(pid, 0)[1]
            except ChildProcessError:
                pass
        if self.pid_ns:
            self._sweep_namespace()
        elif uid is not None:
            self._kill_uid(uid)
        self._reap()
        return status

    @staticmethod
    def _kill_uid(uid):
        # Daemonised children leave the process group; only their uid still names them.
        killer = os.fork()
        if killer == 0:
            try:
                os.setuid(uid)
                for _ in range(1000):
                    os.kill(-1, signal.SIGKILL)
            except BaseException:
                pass
            os._exit(0)
        os.waitpid(killer, 0)

    def _sweep_namespace(self):
        # In our own PID namespace every process but the zygote and its init is leftover.
        for _ in range(1000):
            self._reap()
            alive = []
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in self.keep:
                    continue
                try:
                    with open(f"/proc/{name}/stat", "rb") as handle:
                        state = handle.read().rsplit(b")", 1)[1].split()[0]
                except (OSError, IndexError):
                    continue
                if state not in (b"Z", b"X"):
                    alive.append(int(name))
            if not alive:
                return
            for other in alive:
                try:
                    os.kill(other, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.001)

    @staticmethod
    def _reap():
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    return
            except ChildProcessError:
                return


def main():
    config = json.loads(sys.argv[1])
    for name in config.get("preload", ()):
        try:
            __import__(name)
        except ImportError:
            pass
    if "" in sys.path:
        sys.path.remove("")
    # Everything loaded so far is shared copy-on-write with every child; freezing it keeps
    # the children's garbage collector from touching (and so copying) those pages.
    gc.freeze()
    ctrl_in, ctrl_out = os.dup(0), os.dup(1)
    zygote = Zygote(config)
    # Children inherit fds 0/1; point them at /dev/null so a child can never reach the
    # control pipes even before it redirects its own output.
    os.dup2(zygote.devnull, 0)
    os.dup2(zygote.devnull, 1)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _write_all(ctrl_out, (json.dumps(zygote.info()) + "\n").encode())
    with os.fdopen(ctrl_in, "rb") as requests:
        for line in requests:
            try:
                reply = zygote.run(json.loads(line))
            except Exception as exc:  # keep serving: one bad request is one error reply
                reply = {"status": "error", "error": f"zygote: {exc!r}"[:300]}
            _write_all(ctrl_out, (json.dumps(reply) + "\n").encode())


if __name__ == "__main__":
    main()
