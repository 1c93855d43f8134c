"""Run untrusted model-written Python in a throwaway subprocess.

    sandbox = Sandbox(max_concurrency=4)
    result = await sandbox.run("print(2**100)", timeout_s=5)
    result.output  # '1267650600228229401496703205376\n'

Stateless per call: every call gets a fresh `python -I` process, a fresh temporary directory as cwd
(removed afterwards; if the process that made it was SIGKILLed, by the next process's first run) and
a fresh environment; nothing a call does (files, variables, imports, background
processes) is visible to the next call. The only state is the semaphore in `Sandbox` that caps how many
runs are live.

What contains what (isolation mode "root-ns", used when we are root and `unshare` works; true here):
- wall clock: `timeout_s`, then SIGKILL to the process group and to every process owned by the run's uid.
- forks and stray children: the code runs as its own unprivileged uid, drawn at random per run from a
  range of 2^30 uids no account uses (so RLIMIT_NPROC counts only that run's processes; root ignores
  RLIMIT_NPROC, which is why we switch uid; a collision between two live runs has odds ~1e-8),
  in a new pid namespace whose init is a root shell; when the code exits, the namespace dies and the kernel
  kills whatever it left behind, even processes that called setsid().
- memory, CPU, file size, open files: RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0.
- network: a new, empty network namespace (no interfaces up), so connect() fails at once.
- filesystem: a new mount namespace with /tmp, /var/tmp and /dev/shm read-only (the only world-writable
  places), the run's own directory writable, /proc showing only the sandbox's processes, and any
  unreadable ancestor of the Python install (here /root, mode 700) replaced by an empty tmpfs that
  re-exposes only the Python install, so the sandbox uid can start Python without seeing root's files.
  Everything else is protected by ordinary permissions: the sandbox uid owns nothing outside its dir.
- environment: only PATH, HOME, TMPDIR, LANG and single-thread BLAS settings; nothing of the parent's.
- signals: the sandbox uid may not signal the trainer's processes (different uid), and in the pid
  namespace the parent's pids do not exist (os.getppid() is the namespace's init, owned by root).

Fallbacks (probed once per process, see `isolation_mode`): "user-ns" when not root but unprivileged user
namespaces work (`unshare -rn`): network is isolated, but RLIMIT_NPROC then counts all of our user's
processes, so it is set to the current count plus a margin, which bounds a fork bomb only loosely.
"none": rlimits, a new session and the process-group kill only; no network or filesystem isolation.
"""

import asyncio
import ctypes
import functools
import glob
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

MAX_OUTPUT_BYTES = 16 * 1024  # what the model sees; a tool message should stay small
MEMORY_LIMIT_BYTES = 2 * 1024**3  # RLIMIT_AS: address space, generous for numpy/sympy imports
MAX_PROCESSES = 32  # RLIMIT_NPROC for the sandbox uid (threads count too)
MAX_FILE_BYTES = 16 * 1024**2  # RLIMIT_FSIZE: largest file the code may write
MAX_OPEN_FILES = 128  # RLIMIT_NOFILE
UID_RANGE = (
    1 << 30,
    (1 << 31) - 2,
)  # sandbox uids are drawn from here; no real account should be in it

_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: preexec_fn runs between fork and exec
_PR_SET_PDEATHSIG = 1

_MARKER = "\n\n... [{n} bytes of output omitted] ...\n\n"


@dataclass
class SandboxResult:
    output: str  # stdout and stderr interleaved, decoded with errors="replace", middle cut past the cap
    exit_code: int | None  # the code's exit status; 128+N if killed by signal N; None if it never ran
    timed_out: bool  # killed by the wall-clock timeout
    truncated: bool  # output was longer than max_output_bytes
    duration_s: float  # wall-clock time of the whole call, setup and cleanup included
    error: str = ""  # short reason when something went wrong (timeout, signal, setup failure), else ""


# SETUP: which isolation this machine allows, probed once per process.


def _blocked_ancestors(path: str) -> dict[str, set[str]]:
    """Ancestors of `path` that others cannot traverse, each with the child on the way to `path`."""
    blocked: dict[str, set[str]] = {}
    parts = os.path.realpath(path).split(os.sep)[1:]
    for i in range(len(parts) - 1):
        parent = os.sep + os.sep.join(parts[:i])
        if not os.stat(parent).st_mode & 0o001:
            blocked.setdefault(parent, set()).add(parts[i])
    return blocked


def _prologue(python_paths: list[str]) -> str:
    """Shell run as root inside the new namespaces; $1 = run dir, $2 = uid; then runs python as $2."""
    blocked: dict[str, set[str]] = {}
    for p in python_paths:
        for parent, children in _blocked_ancestors(p).items():
            blocked.setdefault(parent, set()).update(children)
    lines = [
        "set -e",
        # Bind the run dir onto itself first, so it stays writable when /tmp becomes read-only.
        'mount --bind "$1" "$1"',
        "for d in /tmp /var/tmp /dev/shm; do mount --rbind $d $d; mount -o remount,bind,ro $d; done",
    ]
    for parent, children in sorted(blocked.items()):
        # Stash each needed child under the run dir, cover the parent with an empty tmpfs, move it back.
        children = sorted(children)
        for j, child in enumerate(children):
            lines.append(f'mkdir "$1/.stash{j}"; mount --bind "{parent}/{child}" "$1/.stash{j}"')
        lines.append(f'mount -t tmpfs -o size=64k,mode=755 tmpfs "{parent}"')
        for j, child in enumerate(children):
            lines.append(f'mkdir "{parent}/{child}"; mount --move "$1/.stash{j}" "{parent}/{child}"')
            lines.append(f'rmdir "$1/.stash{j}"')
    # The shell stays as pid 1 (root, unkillable by the code) and waits; when it exits the namespace dies.
    lines.append(
        'setpriv --reuid="$2" --regid="$2" --clear-groups --no-new-privs -- "$3" -I main.py; exit $?'
    )
    return "\n".join(lines)


def _python_paths() -> list[str]:
    return [sys.executable, sys.prefix, sys.base_prefix]


@functools.cache
def isolation_mode() -> str:
    """'root-ns', 'user-ns' or 'none': the strongest isolation that actually works here (cached)."""
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("setpriv"):
        workdir = tempfile.mkdtemp(prefix="sandbox-probe-")
        try:
            with open(os.path.join(workdir, "main.py"), "w") as f:
                f.write("print(1)")
            uid = random.SystemRandom().randint(*UID_RANGE)
            os.chown(workdir, uid, uid)
            argv = _root_ns_argv(workdir, uid)
            probe = subprocess.run(
                argv,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin"},
                capture_output=True,
                timeout=30,
                check=False,
            )
            if probe.returncode == 0 and probe.stdout == b"1\n":
                return "root-ns"
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if os.geteuid() != 0 and shutil.which("unshare"):
        probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, check=False)
        if probe.returncode == 0:
            return "user-ns"
    return "none"


def _root_ns_argv(workdir: str, uid: int) -> list[str]:
    return [
        "unshare",
        "--net",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--",
        "/bin/sh",
        "-c",
        _prologue(_python_paths()),
        "sh",
        workdir,
        str(uid),
        sys.executable,
    ]


# RUNNING ONE CALL


def _limits(timeout_s: float, nproc: int) -> None:
    """preexec_fn: rlimits for the whole process tree (inherited across fork and exec), and SIGKILL to
    the run's first process when the thread that started it dies (a kill -9 of the trainer included):
    in root-ns mode that is `unshare --kill-child`, whose death takes the whole pid namespace with it;
    otherwise a run sleeping in a syscall (no CPU time, so no RLIMIT_CPU) would outlive us."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    cpu = int(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _user_process_count() -> int:
    uid = os.getuid()
    n = 0
    for pid in os.listdir("/proc"):
        try:
            n += pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid
        except OSError:
            pass
    return n


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by `uid` (root only), until none is left; a fork bomb is bounded by
    RLIMIT_NPROC, so this converges in a few rounds."""
    for _ in range(100):
        found = False
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
            except OSError:  # exited meanwhile
                pass
        if not found:
            return


async def _drain(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bytes, int]:
    """Read to EOF, keeping the first and last cap/2 bytes; returns (head, tail, total bytes)."""
    half = cap // 2
    head, tail, total = bytearray(), bytearray(), 0
    while chunk := await stream.read(1 << 16):
        total += len(chunk)
        room = half - len(head)
        if room > 0:
            head += chunk[:room]
            chunk = chunk[room:]
        tail += chunk
        if len(tail) > half:
            del tail[: len(tail) - half]
    return bytes(head), bytes(tail), total


def _write_code(workdir: str, code: str) -> None:
    # A few KB written synchronously: cheaper than a thread hop.
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
        f.write(code)


def _signal_kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the pid
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(
    code: str,
    timeout_s: float = 10.0,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> SandboxResult:
    """Run `code` as a fresh `python -I main.py` in a fresh directory; see the module docstring.

    No concurrency cap: use a shared `Sandbox` for that. Never raises for anything the code does;
    a failure to start is reported in `error`.
    """
    mode = isolation_mode()
    uid = random.SystemRandom().randint(*UID_RANGE)  # OS entropy: immune to random.seed()
    start = time.monotonic()
    remove_run_dirs_of_dead_processes()
    workdir = tempfile.mkdtemp(prefix=f"sandbox-{os.getpid()}-")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        # BLAS thread pools count against RLIMIT_NPROC and RLIMIT_AS; one thread is plenty here.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    _write_code(workdir, code)
    if mode == "root-ns":
        os.chown(workdir, uid, uid)
        nproc = MAX_PROCESSES
        argv = _root_ns_argv(workdir, uid)
    elif mode == "user-ns":
        nproc = _user_process_count() + MAX_PROCESSES
        argv = ["unshare", "-rn", "--", sys.executable, "-I", "main.py"]
    else:
        nproc = _user_process_count() + MAX_PROCESSES if os.geteuid() != 0 else MAX_PROCESSES
        argv = [sys.executable, "-I", "main.py"]
    timed_out, error = False, ""
    head, tail, total = b"", b"", 0
    proc = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_limits, timeout_s, nproc),
        )
        drain = asyncio.ensure_future(_drain(proc.stdout, max_output_bytes))
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
        # Always: kill what is left (the code on timeout; background children after a normal exit).
        _signal_kill(proc)
        if mode == "root-ns":
            _kill_uid(uid)
        await proc.wait()
        try:
            head, tail, total = await asyncio.wait_for(drain, 2.0)
        # A writer escaped the kill (only possible without namespaces).
        except TimeoutError:
            error = "output pipe still open after kill"
    except OSError as e:
        error = f"sandbox failed to start: {e}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    exit_code = None if proc is None else proc.returncode
    # asyncio reports death by signal N as -N; the shell convention 128+N reads the same in every mode.
    if exit_code is not None and exit_code < 0:
        exit_code = 128 - exit_code
    if timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif exit_code is not None and exit_code > 128 and not error:
        error = f"killed by signal {exit_code - 128} ({_signal_name(exit_code - 128)})"
    truncated = total > len(head) + len(tail)
    out = (
        head + tail
        if not truncated
        else head + _MARKER.format(n=total - len(head) - len(tail)).encode() + tail
    )
    return SandboxResult(
        output=out.decode("utf-8", errors="replace"),
        exit_code=exit_code,
        timed_out=timed_out,
        truncated=truncated,
        duration_s=time.monotonic() - start,
        error=error,
    )


@functools.cache
def remove_run_dirs_of_dead_processes() -> None:
    """Each run removes its own dir, but a SIGKILLed trainer leaves those of its live runs (the runs
    die with it, by PR_SET_PDEATHSIG; nobody is left to clean up). Run dirs are named after the pid of
    the process that made them, and the first run of every process removes those of dead pids."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "sandbox-*-*")):
        owner = os.path.basename(path).split("-")[1]
        if not owner.isdigit():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unknown"


class Sandbox:
    """Caps how many runs are live at once (share one per trainer); each run is independent.

    The cap is a thread semaphore polled from async code, not an asyncio.Semaphore: the rollout worker's
    loop and the trainer's eval loop share one Sandbox from two threads, and an asyncio primitive binds
    to the first loop that waits on it (the other loop's tool calls then raised under contention)."""

    def __init__(self, max_concurrency: int = 4):
        self._slots = threading.BoundedSemaphore(max_concurrency)

    async def run(
        self,
        code: str,
        timeout_s: float = 10.0,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> SandboxResult:
        while not self._slots.acquire(blocking=False):
            await asyncio.sleep(0.01)  # a run takes ~100 ms: polling costs nothing that matters
        try:
            return await run_python(code, timeout_s, max_output_bytes)
        finally:
            self._slots.release()
