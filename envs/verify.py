"""Answer checking with a hard deadline: math-verify runs in a few worker processes, killed on overrun.

math-verify parses with sympy, and short answers such as `9^{9^{9^{9}}}` or `(10^{10})!` never return
(big-int arithmetic in C, which no thread-level timeout can interrupt; math-verify's own SIGALRM
timeouts only work on the main thread). So the parent sends each (gold, predicted) pair to a worker
over a pipe and waits at most `DEADLINE_S`; a worker that overruns is SIGKILLed and a fresh one takes
its place. A worker's address space is capped (`confine.MEMORY_LIMIT_BYTES`), so an answer that eats
memory faster than the deadline ends in a MemoryError, scored wrong. Owned by envs/math_env.py (its
`answer_verdict`), which retool reuses.

The pool starts on first use, is shared by every thread and event loop of the process (a lock guards
the idle list; waiting happens in the calling thread), and dies with its parent: each worker sets
PR_SET_PDEATHSIG=SIGKILL, and the workers are spawned from one long-lived thread because the kernel
sends that signal when the spawning *thread* exits.
"""

import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

# Hard deadline per answer. An honest answer takes milliseconds in a warm worker; anything slower is
# sympy on a pathological expression that may never return. Short enough that a group of hung answers
# costs seconds, not the run. Set with the trainer's --reward-timeout.
DEADLINE_S = 3.0
POOL_SIZE = 2  # answers checked at once; math-verify is CPU-bound and rewards are a small share of a step
# A worker left holding more than this after an answer is replaced: sympy's caches keep what answers
# computed (each `2^{2*10^8+k}` leaves 100 MB), up to the address-space cap, where every answer that
# needs memory then fails. A fresh worker holds ~60 MB and starts in ~1 s.
RECYCLE_BYTES = 256 * 2**20
START_TIMEOUT_S = 120.0  # a new worker imports sympy and math-verify before it counts against a deadline


class _Worker:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def check(self, gold: str, predicted: str, deadline_s: float) -> bool | None:
        """True/False from math-verify, None if it did not answer within `deadline_s` (then killed)."""
        self.proc.stdin.write(json.dumps([gold, predicted]) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc, deadline_s)
        if line is None:
            self.kill()
            return None
        return line.strip() == "1"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _readline(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """One line from the worker within `timeout_s`; None on timeout or if the worker died."""
    # poll, not select: select refuses descriptors from 1024 up, which a process holding many
    # connections, pipes and files gets.
    poller = select.poll()
    poller.register(proc.stdout, select.POLLIN)
    if not poller.poll(max(0.0, timeout_s) * 1000):
        return None
    line = proc.stdout.readline()  # the worker writes whole lines and flushes, so this cannot block
    return line or None  # "" is EOF: the worker died


def _resident_bytes(pid: int) -> int:
    """The resident memory of `pid` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


class VerifyPool:
    """Up to `size` worker processes running math-verify; `check` blocks the calling thread only."""

    def __init__(self, size: int = POOL_SIZE):
        self._slots = threading.Semaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        # One thread spawns every worker and lives as long as the process: PR_SET_PDEATHSIG fires
        # when the spawning thread exits, and a to_thread worker may not outlive the pool.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-spawner")
        self.timeouts = 0  # answers that overran the deadline, for logs; per-episode counts are in envs

    def _spawn(self) -> _Worker:
        from envs.confine import pin_to_rollout_cpus  # here: the worker runs this file as a script

        cmd = [sys.executable, os.path.abspath(__file__), str(os.getpid())]
        proc = self._spawner.submit(
            subprocess.Popen,
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=pin_to_rollout_cpus,  # whichever thread first checks an answer
        ).result()
        if _readline(proc, START_TIMEOUT_S) != "ready\n":
            proc.kill()
            proc.wait()
            raise RuntimeError(f"answer-checking worker did not start within {START_TIMEOUT_S:.0f} s")
        return _Worker(proc)

    def check(self, gold: str, predicted: str, deadline_s: float | None = None) -> bool | None:
        """math-verify's verdict on `predicted` against `gold`; None when it overran the deadline."""
        deadline_s = DEADLINE_S if deadline_s is None else deadline_s
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker.proc.poll() is not None:  # none yet, or killed from outside
                worker = self._spawn()
            try:
                verdict = worker.check(gold, predicted, deadline_s)
            except (BrokenPipeError, OSError):  # died between answers: a fresh one gets this answer
                worker.kill()
                worker = self._spawn()
                verdict = worker.check(gold, predicted, deadline_s)
            if verdict is None:
                with self._lock:
                    self.timeouts += 1
                return None
            if worker.proc.poll() is None and _resident_bytes(worker.proc.pid) <= RECYCLE_BYTES:
                with self._lock:
                    self._idle.append(worker)
            else:
                worker.kill()
            return verdict

    def pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._idle]


_pool: VerifyPool | None = None
_pool_pid = 0  # a forked child must not share its parent's pipes
_pool_lock = threading.Lock()


def pool() -> VerifyPool:
    """The process's pool, started on first use."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = VerifyPool(), os.getpid()
        return _pool


def check(gold: str, predicted: str) -> bool | None:
    """math-verify equivalence of `predicted` to `gold` within DEADLINE_S; None if it overran."""
    return pool().check(gold, predicted)


def _verify(gold: str, predicted: str) -> bool:
    from math_verify import parse, verify

    try:
        # Wrap both in $...$ so math-verify reads them as LaTeX; `verify(gold, pred)` is not symmetric.
        # Its own timeouts off: the parent's deadline kills this process instead.
        g = parse(f"${gold}$", parsing_timeout=None)
        p = parse(f"${predicted}$", parsing_timeout=None)
        return bool(g and p and verify(g, p, timeout_seconds=None))
    # math-verify/sympy raise many kinds of errors on garbage; garbage is wrong.
    except Exception:  # noqa: BLE001
        return False


def _worker_main(parent_pid: int) -> None:
    from confine import MEMORY_LIMIT_BYTES, die_with_parent  # run as a script: envs/ is sys.path[0]

    if not die_with_parent(parent_pid):  # die with the trainer, even on SIGKILL
        return
    # Some answers eat memory faster than the deadline bounds it (sympy expanding `(x+1)^{10^{9}}`:
    # 0.5 GB a second), and sympy's caches keep what answers that finish computed (each `2^{2*10^8+k}`
    # left 100 MB behind, without end). Past this much address space an allocation fails instead:
    # math-verify reads the MemoryError as a wrong answer and the worker goes on (held at this cap by
    # 20 such answers, it still judged honest ones right).
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; it kills us on exit
    # With timeouts off, math-verify warns "Timeout is disabled" on every call: silence that.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _verify("1", "1")  # import sympy and build the LaTeX grammar before the first deadline starts
    print("ready", flush=True)
    for line in sys.stdin:
        gold, predicted = json.loads(line)
        print("1" if _verify(gold, predicted) else "0", flush=True)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
