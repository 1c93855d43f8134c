"""Run untrusted model-written Python in a throwaway subprocess.

    sandbox = Sandbox(max_concurrency=4)
    result = await sandbox.run("print(2**100)", timeout_s=5)
    result.output  # '1267650600228229401496703205376\n'

Stateless per call: every call gets a fresh process (cold path, `run_python`: a new `python -I`; warm
path, `Sandbox.run` in the namespace modes: a fork of a server with numpy and sympy imported, see
envs/forkserver.py), a fresh run directory as cwd (cold: removed afterwards; warm: a tmpfs; the fork
server's dir goes when its Sandbox closes or the process exits; the dirs of a SIGKILLed process go with
the next process's first run, warm or cold) and a fresh environment (PATH, HOME, TMPDIR, LANG,
single-thread BLAS); nothing a call does (files, variables, imports, background
processes) is visible to the next call. The state in `Sandbox` is the cap on live runs and its fork
server; the process holds one memory and one pids cgroup for all its runs.

Isolation modes, the strongest that works here is probed once per process (`isolation_mode`):
- "root-ns" (root with CAP_SYS_ADMIN): new pid, net and mount namespaces (`unshare`). A root shell,
  pid 1 of the namespace, assembles a minimal root from read-only binds (/usr, /bin, /lib*, the Python
  install, the venv), the four harmless devices, an empty private /tmp and /dev/shm, a /proc of the
  namespace, and a 64 MiB tmpfs at /sandbox holding a copy of main.py (the host's run dir, on its disk,
  is never the code's: RLIMIT_FSIZE bounds a file, not how many); enters it with pivot_root (the old
  root is detached, so the checkout, datasets, runs/, /root and /home do not exist for the code) and
  runs the code as an unprivileged uid drawn per run from 2^30 unused uids (RLIMIT_NPROC then counts
  only that run; root ignores it). When the code exits, the namespace dies and the kernel kills
  whatever it left behind. No interface is up in the net namespace; the trainer's pids do not exist in
  the pid namespace.
- "user-ns" (not root, or root without CAP_SYS_ADMIN, where unprivileged user namespaces work): the
  same namespaces and minimal root inside a user namespace. As root, we write its uid and gid maps
  (`_map_ids`) and the code runs as a drawn uid, as in root-ns. Not root, the code runs as the
  namespace's root (our uid) with every capability dropped (so it cannot undo the mounts);
  RLIMIT_NPROC counts our uid's processes: set to the current count plus a margin.
- "seccomp" (no namespace can be made; libseccomp present): see envs/confine.py. As root the code
  runs as a drawn uid (or, when the Python install lies below a directory others cannot enter, as
  root with every capability dropped); not root, as our uid. seccomp denies sockets, ptrace and
  signals outside the run's process group; Landlock, where the kernel has it, limits the files to the
  Python install (read) and the run dir. Without Landlock and not root, the code can read whatever our
  uid can, /proc/<trainer>/environ included; as capability-less root, every root-owned file:
  `isolation_gaps` says so and the trainer refuses. The run dir lies on the machine's disk: a watcher
  process (envs/diskwatch.py) kills a run that holds more than confine.MAX_DIR_BYTES there.
- "none": rlimits, a new session and the process-group kill only.

Without a pid namespace (seccomp, none) the run's first process is a child subreaper (`_REAPER`): the
run's orphans (a setsid() or double-fork daemon) come back to it, not to init, until the run has ended.
Every mode: wall clock (`timeout_s`, then SIGKILL to every process of the run: the descendants of its
first process, its group and, where it drew one, its uid), RLIMIT_AS/CPU/FSIZE/NOFILE/CORE per
process, and one memory and one pids cgroup (v2, or v1) for all runs together where one can be made
(envs/confine.py): the pids limit bounds a fork bomb where RLIMIT_NPROC does not (uid 0); a run the
kernel OOM-kills says so in its `error`. A run cancelled mid-way is killed the same way; a cold run whose
event loop closes under it, by a thread of its own past its timeout (`_watch_clock`). Disk: 64 MiB
(confine.MAX_DIR_BYTES) per tmpfs in the namespace modes (ENOSPC past it); elsewhere the disk watcher
kills the run past it, with one poll interval's writing beyond (docs/sandbox.md). CPUs: with
--rollout-cpus the runs pin themselves to those, and a cpuset cgroup, where one can be made, keeps
code that widens its own affinity on them.
"""

import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import resource
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from envs import confine

MAX_OUTPUT_BYTES = 16 * 1024  # what the model sees; a tool message should stay small
MEMORY_BUDGET_BYTES = 4 * 1024**3  # the memory cgroup: resident memory of all live runs together
MAX_PROCESSES = 32  # RLIMIT_NPROC for the sandbox uid (threads count too)
UID_RANGE = (1 << 30, (1 << 31) - 2)  # sandbox uids are drawn from here; no real account should be in it
RUN_DIR_INSIDE = "/sandbox"  # where the run dir appears in the namespace modes' minimal root
# The devices the code may open (what else it may read: confine.visible_paths).
DEVICES = ["null", "zero", "random", "urandom"]

_MARKER = "\n\n... [{n} bytes of output omitted] ...\n\n"


@dataclass
class SandboxResult:
    # stdout and stderr interleaved, decoded with errors="replace"; past the cap, the middle cut out at
    # UTF-8 character boundaries (`_whole_characters`)
    output: str
    exit_code: int | None  # the code's exit status; 128+N if killed by signal N; None if it never ran
    timed_out: bool  # killed by the wall-clock timeout
    truncated: bool  # output was longer than max_output_bytes
    duration_s: float  # wall-clock time of the whole call, setup and cleanup included
    error: str = ""  # short reason when something went wrong (timeout, signal, OOM, setup failure)


# SETUP: what the code may see, and which isolation this machine allows (probed once per process).


def _hidden_by_fresh_tmpfs() -> dict:
    """What of the minimal root lies below /tmp or /dev/shm (a Python install in a temp dir, as a CI
    clone has it), which a warm call's fresh tmpfs there would hide: the fork server puts it back."""
    binds, links = confine.visible_paths()

    def below(p: str) -> bool:
        return p.startswith(("/tmp/", "/dev/shm/"))

    return {"binds": [p for p in binds if below(p)], "links": {k: v for k, v in links.items() if below(k)}}


@functools.cache
def _ns_prologue(cold: bool = True) -> str:
    """Shell run as root in the new namespaces. $1 = the run's base dir (run/main.py = the code, copied
    into a fresh tmpfs at /sandbox if `cold`: the fork server makes one per call; root/ = an empty mount
    point; unused once the command runs); $2 = the uid that owns /sandbox; the rest = the command that
    drops privileges and runs python, as pid 1's child (pid 1 stays a root shell the code cannot kill;
    when it exits the namespace dies)."""
    binds, links = confine.visible_paths()
    q = shlex.quote
    files = [p for p in binds if not os.path.isdir(p)]
    dirs = [p for p in binds if os.path.isdir(p)] + [os.path.dirname(k) for k in links]
    dirs += [RUN_DIR_INSIDE, "/tmp", "/proc", "/dev/shm"] + [os.path.dirname(p) for p in files]
    lines = [
        "set -e",
        'R="$1/root"',
        'mount -t tmpfs -o size=1m,mode=755,nosuid,nodev sandbox-root "$R"',
        # The private /tmp and /dev/shm first: a Python install under /tmp (a checkout in a temp dir,
        # as CI makes) is bound inside them below, not hidden under them.
        'mkdir -p "$R/tmp" "$R/dev/shm"',
        'mount -t tmpfs -o size=64m,mode=1777,nosuid,nodev sandbox-tmp "$R/tmp"',
        'mount -t tmpfs -o size=64m,mode=1777,nosuid,nodev sandbox-shm "$R/dev/shm"',
        "mkdir -p " + " ".join(f'"$R"{q(d)}' for d in sorted(set(dirs))),
        "touch " + " ".join(f'"$R"{q(p)}' for p in files + [f"/dev/{d}" for d in DEVICES]),
    ]
    lines += [f'ln -s {q(target)} "$R"{q(link)}' for link, target in sorted(links.items())]
    lines += [f'mount -o bind,ro,nosuid,nodev {q(p)} "$R"{q(p)}' for p in binds]
    lines += [f'mount -o bind /dev/{d} "$R/dev/{d}"' for d in DEVICES]
    # The code's dir is a tmpfs of the warm path's size, not the host's run dir: that lies on the
    # machine's disk, where RLIMIT_FSIZE bounds each file but not how many (640 MiB in 0.2 s seen).
    lines += [
        f"mount -t tmpfs -o size={confine.MAX_DIR_BYTES >> 20}m,mode=755,uid=$2,gid=$2,nosuid,nodev"
        f' sandbox-run "$R{RUN_DIR_INSIDE}"',
        f'cp "$1/run/main.py" "$R{RUN_DIR_INSIDE}/main.py"',
    ] * cold
    lines += [
        'mount -t proc -o nosuid,nodev,noexec proc "$R/proc"',
        'mount -o remount,bind,ro,nosuid,nodev "$R"',
        'cd "$R"',
        f"{shutil.which('pivot_root')} . .",  # the old root ends up stacked under the new one ...
        "umount -l .",  # ... and is detached here: nothing outside the minimal root is reachable
        f"cd {RUN_DIR_INSIDE}",
        "shift 2",
        # The shell's own "Killed" for a killed code to nowhere: it is not the code's output. A
        # subshell: dash waits for a plain command with that command's redirections still applied.
        'exec 3>&2 2>/dev/null; (exec "$@" 2>&3 3>&-); exit $?',
    ]
    return "\n".join(lines)


# The first process of a run without a pid namespace (`_reaps`), a child subreaper (`_preexec`): runs
# the code in a session of its own (dying with us: --pdeathsig), says its exit status on its stdin, a
# socket, and waits there, holding the run's orphans, until `_end_run` has killed them and closes it.
# Its own stderr is /dev/null: the shell's "Killed" for a killed code is not the code's output.
# Told to reap ($0: this Python), it waits for every child before it exits: left to init, the killed
# orphans are reaped at init's pace (~2 s under some container inits), and fill the pids cgroup until.
_REAPER = (
    'exec 3>&2 2>/dev/null; "$@" </dev/null 2>&3 3>&- & wait $!; echo $? >&0; read r; '
    '[ "$r" = reap ] && exec "$0" -I -S -c "import os\n'
    'try:\n while 1: os.wait()\nexcept ChildProcessError: pass"; exit 0'
)


def _reaps(mode: str, budget: int) -> bool:
    """Does the run start below `_REAPER`? Without a pid namespace, where the code may fork at all."""
    tools = shutil.which("setsid") and shutil.which("setpriv")
    return mode in ("seccomp", "none") and bool(tools) and not _unbounded(mode, budget)


def _command(mode: str, base: str, uid: int, server_fd: int | None = None, reaper: bool = False) -> list[str]:
    """argv of one run (cwd is base/run in the modes without a mount namespace); with server_fd, of
    the namespace modes' fork server instead, which stays the namespaces' root (envs/forkserver.py).
    Where `_maps_ids` (or with `reaper`: below `_REAPER`) its stdin is a socket to us."""
    python = [sys.executable, "-I", "main.py"]
    if reaper:
        pdeathsig = [shutil.which("setpriv"), "--pdeathsig=KILL", "--"]
        python = ["/bin/sh", "-c", _REAPER, sys.executable, shutil.which("setsid"), "-w", *pdeathsig, *python]
    # --ipc: SysV shared memory, message queues and POSIX mqueues outlive their process (a 256 MiB
    # segment stayed in the memory cgroup after its run; a queue was the next run's); their namespace
    # dies with the run.
    ns = ["unshare", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount", "--propagation",
          "private"]  # fmt: skip
    owner = str(uid if _draws_uid(mode) else 0)  # user-ns as a plain user: the namespace's root, us
    shell = ["/bin/sh", "-c", _ns_prologue(server_fd is None), "sh", base, owner]
    user = []
    if _draws_uid(mode):
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
    elif mode == "user-ns":
        drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        ns.insert(1, "--map-root-user")
    if _maps_ids(mode):
        # A user namespace first, whose maps we write from outside: the other namespaces are made by
        # a fresh exec once its root is mapped (an exec before that drops every capability).
        user = ["unshare", "--user", "--", "/bin/sh", "-c", 'echo >&0; read _; exec "$@" </dev/null', "sh"]
    if mode in ("root-ns", "user-ns"):
        if server_fd is not None:
            drop, python = [], [sys.executable, "-I", "-c", _forkserver_source(), str(server_fd)]
            python.append(json.dumps(_hidden_by_fresh_tmpfs()))
        return [*user, *ns, "--", *shell, *drop, *python]
    if mode == "seccomp" and os.geteuid() == 0:
        if confine.python_reachable_by_others():
            # the uid change clears the parent-death signal _preexec set: set again
            drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--pdeathsig=KILL"]
            return [*drop, "--", *python]
        return ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--", *python]
    return python


@functools.cache
def _forkserver_source() -> str:
    return open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")).read()


def _draws_uid(mode: str) -> bool:
    """Does the code run as its own drawn uid (so RLIMIT_NPROC and the kill-by-uid work)?"""
    if mode == "seccomp":
        return os.geteuid() == 0 and confine.python_reachable_by_others()
    return mode == "root-ns" or _maps_ids(mode)


def _unbounded(mode: str, budget: int) -> bool:
    """Would nothing bound a fork bomb? The code runs as uid 0 (capability-less root in mode seccomp),
    which RLIMIT_NPROC exempts, and no pids cgroup can be made (a read-only /sys/fs/cgroup, as in a
    default Docker container): then seccomp refuses it new processes and threads
    (`confine.seccomp_filter`)."""
    root = mode == "seccomp" and os.geteuid() == 0 and not _draws_uid(mode)
    return root and confine.pids_cgroup(budget) is None


def forks_refused() -> bool:
    """Is the code refused every new process and thread here (`_unbounded`)? Said at start-up."""
    return _unbounded(isolation_mode(), MEMORY_BUDGET_BYTES)


def _maps_ids(mode: str) -> bool:
    return mode == "user-ns" and os.geteuid() == 0


def _map_ids(pid: int, sock: socket.socket) -> None:
    """Mode user-ns as root (`_maps_ids`): once run `pid` says (on `sock`, its stdin) that it is in its
    new user namespace, map uid and gid 0 there to ours (the namespaces' root shell, which makes the
    minimal root) and the sandbox uid range to itself (the code drops to a drawn uid in it, as in
    root-ns; as the namespace's root it would be the real uid 0, which RLIMIT_NPROC exempts). A
    multi-line map needs CAP_SETUID/CAP_SETGID where the namespace was made, which root without
    CAP_SYS_ADMIN keeps. A run that died first is left to report its own exit. Blocking: call it off
    the event loop."""
    lo, hi = UID_RANGE
    try:
        sock.settimeout(30)
        if sock.recv(1):
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(f"0 0 1\n{lo} {lo} {hi - lo + 1}\n")
            sock.sendall(b"\n")
    except OSError:
        pass
    finally:
        sock.close()


def _preexec(
    mode: str,
    run_dir: str,
    timeout_s: float,
    nproc: int,
    cgroup_procs: list[str],
    no_fork: bool = False,
    started: int | None = None,
    enlist: tuple[int, str] | None = None,
) -> None:
    """Between fork and exec: join the sandbox cgroups (memory budget, process limit), set the rlimits
    (inherited by the whole process tree), and SIGKILL the run's first process when the thread that
    started it dies (a kill -9 of the trainer included): in the namespace modes that is `unshare
    --kill-child`, whose death takes the pid namespace with it; otherwise a run sleeping in a syscall
    (no CPU time) would outlive us.
    In mode "seccomp", confine (seccomp + Landlock; `no_fork`: see `_unbounded`) last. `started`: a
    pipe our pid is written to (`_started_pid`). `enlist`: the disk watcher's fd and the line that
    puts us under it (`_DiskWatcher`), written before the code can write a byte."""
    if started is not None:
        os.write(started, os.getpid().to_bytes(8, "little"))
    if enlist is not None:  # one write of under PIPE_BUF bytes: never interleaved with another run's
        os.write(enlist[0], enlist[1].replace("{pid}", str(os.getpid())).encode())
    confine.die_with_parent(os.getppid())
    if mode in ("seccomp", "none"):
        confine.become_subreaper()  # for `_REAPER`: set before exec, kept across it
    _join(cgroup_procs)
    if mode == "seccomp":
        readable = confine.visible_paths()[0] + ["/sys/devices/system/cpu"]
        confine.confine(readable, [run_dir] + [f"/dev/{d}" for d in DEVICES], no_fork)
    # The rlimits last: until the exec closes them we hold the trainer's descriptors, and under
    # RLIMIT_NOFILE (128) a new one must be numbered below it: Landlock's ruleset failed with EMFILE in
    # every run of a process holding 128 descriptors (many connections to the servers).
    for name, limits in confine.rlimits(timeout_s, nproc).items():
        resource.setrlimit(getattr(resource, name), limits)


def _probe(mode: str) -> bool:
    """Run print(1) in `mode`, synchronously (isolation_mode may be called inside an event loop)."""
    base = _make_base(mode, uid := random.SystemRandom().randint(*UID_RANGE), "print(1)")
    reaper = _reaps(mode, MEMORY_BUDGET_BYTES)
    ours, theirs = socket.socketpair() if _maps_ids(mode) or reaper else (None, None)
    try:
        with subprocess.Popen(
            _command(mode, base, uid, reaper=reaper),
            cwd=os.path.join(base, "run"),
            env=_env(mode, base),
            stdin=theirs.fileno() if theirs else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=functools.partial(_preexec, mode, os.path.join(base, "run"), 30, _nproc(mode), []),
        ) as probe:
            if theirs:
                theirs.close()
            status = b"0\n"  # what the reaper says, where there is one
            if _maps_ids(mode):
                _map_ids(probe.pid, ours)
            elif reaper:
                ours.settimeout(30)
                status = ours.recv(16)
                ours.close()  # the reaper's cue to exit
            try:
                out, _ = probe.communicate(timeout=30)
            finally:
                probe.kill()
        return probe.returncode == 0 and out == b"1\n" and status == b"0\n"
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        for sock in (ours, theirs):
            if sock:
                sock.close()
        shutil.rmtree(base, ignore_errors=True)


@functools.cache
def isolation_mode() -> str:
    """'root-ns', 'user-ns', 'seccomp' or 'none': the strongest isolation that works here (cached)."""
    tools = shutil.which("unshare") and shutil.which("setpriv") and shutil.which("pivot_root")
    if tools and os.geteuid() == 0 and _probe("root-ns"):
        return "root-ns"
    if tools and _probe("user-ns"):
        return "user-ns"
    confine.landlock_ruleset_rights()  # probed here, in the parent: a preexec_fn only reads it
    if (
        confine.seccomp_filter() is not None
        and (os.geteuid() != 0 or shutil.which("setpriv"))
        and _probe("seccomp")
    ):
        return "seccomp"
    return "none"


def isolation_gaps() -> list[str]:
    """What the mode in use cannot stop, among the three the trainer refuses to run without."""
    mode = isolation_mode()
    if mode == "none":
        return ["network access", "reading the trainer's environment", "signalling the trainer"]
    if mode == "seccomp" and not confine.landlock_ruleset_rights()[1]:
        if os.geteuid() != 0:
            return ["reading the trainer's environment (/proc/<pid>/environ: same uid, and no Landlock)"]
        if not _draws_uid(mode):  # uid 0 without capabilities still owns every root-owned file
            return [
                "reading and writing every root-owned file, /etc/shadow included (the code runs as "
                "root without capabilities, and no Landlock: use a kernel with Landlock, or a Python "
                "install that other users can reach, e.g. in /usr/local, not below /root)"
            ]
    return []


# RUNNING ONE CALL


def _make_base(mode: str, uid: int, code: str) -> str:
    """base/run (the code's dir, with main.py) and, in the namespace modes, base/root (a mount point)."""
    confine.remove_run_dirs_of_dead_processes()
    base = tempfile.mkdtemp(prefix=f"sandbox-{confine.owner_tag()}-")
    run_dir = os.path.join(base, "run")
    os.mkdir(run_dir)
    # A few KB written synchronously: cheaper than a thread hop.
    with open(os.path.join(run_dir, "main.py"), "w", encoding="utf-8", errors="replace") as f:
        f.write(code)
    if mode in ("root-ns", "user-ns"):
        os.mkdir(os.path.join(base, "root"))
    if _draws_uid(mode):
        os.chmod(base, 0o711)  # the drawn uid must pass through to run/
        os.chown(run_dir, uid, uid)
        os.chown(os.path.join(run_dir, "main.py"), uid, uid)
    return base


def _env(mode: str, base: str) -> dict[str, str]:
    home = RUN_DIR_INSIDE if mode in ("root-ns", "user-ns") else os.path.join(base, "run")
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": "/tmp" if mode in ("root-ns", "user-ns") else home,
        "LANG": "C.UTF-8",
        # BLAS thread pools count against RLIMIT_NPROC and RLIMIT_AS; one thread is plenty here.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _nproc(mode: str) -> int:
    """RLIMIT_NPROC: counts the processes of the run's real uid, which is ours unless it drew one."""
    drawn_or_root = _draws_uid(mode) or os.geteuid() == 0
    return MAX_PROCESSES + (0 if drawn_or_root else confine.user_process_count())


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


async def _reaper_status(sock: socket.socket) -> int | None:
    """The code's exit status as `_REAPER` reports it; None if it said nothing."""
    sock.setblocking(False)
    loop, data = asyncio.get_running_loop(), b""
    while not data.endswith(b"\n") and (chunk := await loop.sock_recv(sock, 16)):
        data += chunk
    return int(data) if data.strip().isdigit() else None


async def _end_run(
    proc: asyncio.subprocess.Process, uid: int | None, reaper: socket.socket | None, namespaces: bool
) -> None:
    """Kill every process of the run and wait until they are gone (a fork bomb is bounded by RLIMIT_NPROC
    or the pids cgroup: a few rounds). In the `namespaces` modes the code's processes go first: the
    namespace's pid 1, the prologue's shell, then exits with the code's status, and `unshare` with it,
    each reaping what it holds. Killed first, `unshare` left its child to init, which reaped it at its
    pace (a timed-out run of 1 s returned after 2-3 s; where the trainer is a container's pid 1, which
    reaps nothing, at the 5 s deadline, leaving a zombie); its pid 1 killed, `unshare` reported
    "sigprocmask unblock failed" and exit 1 (util-linux 2.38).
    A reaper goes last too (what it still holds would go to init); the code itself (mode seccomp
    where it may not fork: `_unbounded`) first."""
    deadline = time.monotonic() + 5
    left = await _kill_until_gone(proc.pid, uid, deadline, spare_init=namespaces)
    if reaper is None:
        if namespaces:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), max(deadline - time.monotonic(), 0.1))
        _signal_kill(proc)  # past the deadline, `unshare --kill-child` takes the namespace with it
    else:
        with contextlib.suppress(OSError):
            reaper.sendall(b"reap\n" if left else b"\n")  # the killed orphans are its children now
        reaper.close()  # its cue to exit, where it waits for it
        try:
            await asyncio.wait_for(proc.wait(), max(deadline - time.monotonic(), 0.1))
        except TimeoutError:  # a child it cannot reap (one left alive past the deadline)
            _signal_kill(proc)
    await proc.wait()
    # The zombies go with their reaper: `_REAPER` as it exits, the namespace's pid 1 as it dies, or init
    # where one outlived the deadline. Until then they are the run's (a run that returned with one was
    # seen) and fill its pids cgroup.
    while any(os.path.exists(f"/proc/{pid}") for pid in left) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


async def _spawn(argv: list[str], theirs: socket.socket | None, **kwargs) -> asyncio.subprocess.Process:
    """Start a cold run: its stdin is `theirs` (closed here, once the child has its copy) or nothing."""
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=theirs.fileno() if theirs else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
        )
    finally:
        if theirs:
            theirs.close()


def _started_pid(started: int) -> int | None:
    """The pid `_preexec` wrote to the pipe `started` (non-blocking): None if no process was made."""
    try:
        data = os.read(started, 8)
    except OSError:
        return None
    return int.from_bytes(data, "little") if len(data) == 8 else None


async def _kill_until_gone(
    first: int, uid: int | None, deadline: float, spare_init: bool = False
) -> dict[int, str]:
    """confine.kill_until_gone for the event loop: its rounds awaited, not slept."""
    while (
        set((left := confine.kill_run(first, uid, spare_init)).values()) - {"Z"}
        and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.005)
    return left


def _end_run_off_loop(
    proc: asyncio.subprocess.Process, uid: int | None, reaper: bool, namespaces: bool
) -> None:
    """`_end_run` where no event loop is left to wait on: kill every process of the run, the first
    last where it is a reaper or, in the `namespaces` modes, `unshare`, which then exits with the
    namespace's pid 1 and reaps it (killed first, it left that pid 1 to init: a zombie for good where
    the trainer is pid 1). Reaped by asyncio's child watcher thread (or, the reaper gone, init)."""
    deadline = time.monotonic() + 5
    if not reaper and not namespaces:
        _signal_kill(proc)
    confine.kill_until_gone(proc.pid, uid, deadline, spare_init=namespaces)
    while namespaces and not confine.exiting(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    _signal_kill(proc)


CLOCK_GRACE_S = 5.0  # how long past its timeout a cold run's loop has to end it before `_watch_clock` does


def _watch_clock(
    proc, uid: int | None, reaper: bool, namespaces: bool, base: str, timeout_s: float, stopped, fired
) -> None:
    """A cold run's wall clock, kept off the event loop too, in a thread of its own until `stopped`: a
    loop closed (or never run again) with the call pending would never end the run, whose code then
    ran until our process exited. Past `timeout_s` + CLOCK_GRACE_S the run is killed and its dir
    removed here."""
    if stopped.wait(timeout_s + CLOCK_GRACE_S) or proc.returncode is not None:
        return
    fired.set()
    _end_run_off_loop(proc, uid, reaper, namespaces)
    confine.remove_tree(base)


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _signal_kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the pid
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(
    code: str,
    timeout_s: float = 10.0,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
    memory_budget_bytes: int = MEMORY_BUDGET_BYTES,
) -> SandboxResult:
    """Run `code` as a fresh `python -I main.py` in a fresh directory (the cold path); see the module
    docstring. No concurrency cap: use a shared `Sandbox` for that. Never raises for anything the code
    does; a failure to start is reported in `error`."""
    mode, budget = isolation_mode(), memory_budget_bytes
    uid = random.SystemRandom().randint(*UID_RANGE)  # OS entropy: immune to random.seed()
    start = time.monotonic()
    cgroup = confine.memory_cgroup(memory_budget_bytes)
    ooms_before = confine.oom_kills(cgroup)
    loop = asyncio.get_running_loop()
    # Modes seccomp and none: the run's id with the disk watcher and its fd; set if the watcher dies.
    watch, watcher_gone = None, asyncio.Event()
    if mode in ("seccomp", "none"):  # the run dir lies on the machine's disk, not in a tmpfs
        try:
            on_gone = functools.partial(_call_soon, loop, watcher_gone.set)
            watch = await asyncio.to_thread(_DISK_WATCHER.start, on_gone)
        except OSError as e:
            error = f"sandbox failed to start: {e}"
            return _result(start, (b"", b"", 0), None, False, error, timeout_s, False, budget)
    base = _make_base(mode, uid, code)
    run_dir = os.path.join(base, "run")
    timed_out, error, status = False, "", None
    head, tail, total = b"", b"", 0
    proc = None
    reaper, owner = _reaps(mode, budget), uid if _draws_uid(mode) else None
    namespaces = mode in ("root-ns", "user-ns")
    ours, theirs = socket.socketpair() if _maps_ids(mode) or reaper else (None, None)
    limits = (timeout_s, _nproc(mode), confine.cgroup_procs(budget), _unbounded(mode, budget))
    stopped = threading.Event()  # the run is over: `_watch_clock` stops
    enlist = None
    if watch is not None:  # written by the first process before it execs: "{pid}" is its pid
        enlist = (
            watch[1],
            f"watch {watch[0]} {{pid}} {-1 if owner is None else owner} {int(reaper)} {run_dir}\n",
        )
    clock_fired, closed = threading.Event(), False  # `_watch_clock` ended the run; see GeneratorExit below
    # The first process's pid as soon as it exists: a cancelled start returns no process to end.
    started_r, started_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    spawn = asyncio.ensure_future(
        _spawn(
            _command(mode, base, uid, reaper=reaper),
            theirs,
            cwd=run_dir,
            env=_env(mode, base),
            preexec_fn=functools.partial(_preexec, mode, run_dir, *limits, started=started_w, enlist=enlist),
        )
    )
    try:
        # Shielded: asyncio kills a process whose start is cancelled (its first process alone), which
        # hands the code's processes to init, out of reach, past every deadline. It starts; the run
        # is then ended below as any cancelled run is. asyncio.run's end cancels `spawn` itself too:
        # then what is left is found from the first process's pid (`_started_pid`).
        proc = await asyncio.shield(spawn)
        args = (proc, owner, reaper, namespaces, base, timeout_s, stopped, clock_fired)
        threading.Thread(target=_watch_clock, args=args, daemon=True, name="sandbox-clock").start()
        if _maps_ids(mode):
            await asyncio.to_thread(_map_ids, proc.pid, ours)
        drain = asyncio.ensure_future(_drain(proc.stdout, max_output_bytes))
        ended = asyncio.ensure_future(_reaper_status(ours) if reaper else proc.wait())
        # The watcher kills a run past the cap itself (then `ended`); its death leaves the run unwatched.
        gone = asyncio.ensure_future(watcher_gone.wait())
        try:
            done, _ = await asyncio.wait({ended, gone}, timeout=timeout_s, return_when="FIRST_COMPLETED")
        finally:
            ended.cancel()
            gone.cancel()
        if ended in done:
            status = ended.result()
        elif gone not in done:
            timed_out = True
            # Killed by `_end_run` below; the reaper's status is not read once its wait is cancelled.
            status = 128 + signal.SIGKILL if reaper else None
        if watch is not None:  # ended here, whatever the watcher finds from now on
            answer = loop.create_future()
            _DISK_WATCHER.killed(watch[0], functools.partial(_call_soon, loop, _settle, answer))
            watch = None
            try:
                killed = gone in done or await asyncio.wait_for(answer, 10)
            except TimeoutError:  # a watcher that slow: no verdict
                killed = False
            if killed:
                status = 128 + signal.SIGKILL if status is None else status  # what the reaper would say
                error = (
                    f"wrote more than {confine.MAX_DIR_BYTES >> 20} MiB (or {confine.MAX_DIR_ENTRIES} files) "
                    "to disk, or what it holds could not be told: killed (the sandbox's disk cap)"
                )
        await _end_run(proc, owner, ours if reaper else None, namespaces)
        try:
            head, tail, total = await asyncio.wait_for(drain, 2.0)
        # A writer escaped the kill (only possible without namespaces).
        except TimeoutError:
            error = "output pipe still open after kill"
    except (OSError, subprocess.SubprocessError) as e:
        error = f"sandbox failed to start: {e}"
    except GeneratorExit:
        closed = True
        raise
    finally:
        stopped.set()
        if watch is not None:  # not asked above (cancelled, or it failed to start): stop watching it
            _DISK_WATCHER.killed(watch[0], lambda _: None)
        # Closed, not cancelled (its loop gone, by the garbage collector): nothing can be awaited.
        closed = closed or not _running_on(loop)
        if closed:
            if proc is not None and proc.returncode is None:
                _end_run_off_loop(proc, owner, reaper, namespaces)
        elif proc is None:  # cancelled while it started
            with contextlib.suppress(OSError, subprocess.SubprocessError, asyncio.CancelledError):
                proc = await spawn
            # asyncio killed the first process alone, which in the namespace modes can land before
            # `unshare`'s child set its parent-death signal (--kill-child): the namespace's pid 1, in
            # the first's group, runs the code on.
            if spawn.cancelled() and (first := _started_pid(started_r)) is not None:
                await _kill_until_gone(first, owner, time.monotonic() + 5)
        if not closed and proc is not None and proc.returncode is None:  # cancelled: ended all the same
            # With the reaper too: killed first, it would hand the run's processes to init, out of reach.
            await _end_run(proc, owner, ours if reaper else None, namespaces)
        if ours:
            ours.close()
        os.close(started_r)
        os.close(started_w)
        confine.remove_tree(base)
    exit_code = None if proc is None else proc.returncode if status is None or not reaper else status
    timed_out = timed_out or clock_fired.is_set()  # a loop that ran late: the clock killed the run
    oom = confine.oom_kills(cgroup) > ooms_before
    return _result(
        start, (head, tail, total), exit_code, timed_out, error, timeout_s, oom, memory_budget_bytes
    )


class _DiskWatcher:
    """Our end of envs/diskwatch.py's process, one per trainer process (started by the first run that
    needs it): the run dirs of modes seccomp and none are measured, and a run past the cap killed,
    there, not in a thread beside the trainer's, whose GIL made one look take up to a second (see that
    module). A run's first process enlists itself before it execs (`_preexec`), so the code cannot
    write a byte unwatched, however late our own threads run; `killed` ends the watch and answers
    whether the watcher killed the run. Should the process die, the runs it watched are told (then
    killed as if over the cap: what they hold can no longer be told); the next run starts another.
    A thread of ours reads its reports and hands them on through the callbacks given, which must be
    safe to call from any thread (`_call_soon`)."""

    def __init__(self) -> None:
        self._forget()
        # A forked child (rollout_process.py) starts a watcher of its own: the answers to its runs would
        # go to our reader, not to one of its own, and our lock may have been held as it forked.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ids = itertools.count()
        self._on_gone: dict[str, tuple[subprocess.Popen, Callable[[], None]]] = {}  # runs watched
        self._asked: dict[str, tuple[subprocess.Popen, Callable[[bool], None]]] = {}  # `killed`, unanswered
        self._killed: set[str] = set()  # runs reported killed, until asked

    def start(self, on_gone: Callable[[], None]) -> tuple[str, int]:
        """A run's id and the fd its first process writes "watch ID PID ..." to; `on_gone` is called
        should the process die before `killed`. Starts the process unless it runs (~0.1 s); OSError if
        it cannot be."""
        with self._lock:
            proc = self._running()
            run_id = f"{proc.pid}.{next(self._ids)}"
            self._on_gone[run_id] = (proc, on_gone)
            return run_id, proc.stdin.fileno()

    def _running(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source = f"import sys\nsys.path.insert(0, {root!r})\nfrom envs import diskwatch\ndiskwatch.main()"
        # A session of its own: a Ctrl-C to the trainer's terminal is not its to print a traceback for.
        argv = [sys.executable, "-I", "-c", source]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        started = select.poll()  # not select.select: it refuses descriptors from 1024 up
        started.register(proc.stdout, select.POLLIN)
        if not started.poll(60_000) or proc.stdout.readline() != b"ready\n":
            proc.kill()
            proc.wait()
            raise OSError("the disk watcher (envs/diskwatch.py) did not start")
        self._proc = proc
        threading.Thread(target=self._read, args=(proc,), daemon=True, name="sandbox-disk").start()
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # "full ID" (killed), "stopped ID" (the answer to `killed`)
            kind, run_id = line.decode().split()
            with self._lock:
                if kind == "full":
                    self._killed.add(run_id)
                    continue
                _, on_answer = self._asked.pop(run_id, (None, None))
                was_killed = run_id in self._killed
                self._killed.discard(run_id)
            if on_answer is not None:
                on_answer(was_killed)
        with self._lock:
            proc.wait()  # its returncode marks it dead for `_running`
            gone = [self._on_gone.pop(i)[1] for i, (p, _) in list(self._on_gone.items()) if p is proc]
            unanswered = [self._asked.pop(i)[1] for i, (p, _) in list(self._asked.items()) if p is proc]
        for on_gone in gone:
            on_gone()
        for on_answer in unanswered:  # what it watched went unwatched: as if over the cap
            on_answer(True)

    def killed(self, run_id: str, on_answer: Callable[[bool], None]) -> None:
        """Stop watching run `run_id`; `on_answer(did the watcher kill it)` follows every report of the
        run (one pipe keeps their order)."""
        with self._lock:
            proc, _ = self._on_gone.pop(run_id, (None, None))
            if proc is not None:
                self._asked[run_id] = (proc, on_answer)
                with contextlib.suppress(OSError):  # dead meanwhile: `_read` answers
                    os.write(proc.stdin.fileno(), f"stop {run_id}\n".encode())
                return
        on_answer(True)  # its watcher died under it


_DISK_WATCHER = _DiskWatcher()


def _settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: its run is over anyway
        loop.call_soon_threadsafe(callback, *args)


def _whole_characters(head: bytes, tail: bytes) -> tuple[bytes, bytes]:
    """The cap's head and tail less the pieces of a UTF-8 character the cut split: decoded, they would
    show the model U+FFFD beside the marker. At most 3 bytes go from each side; bytes the code wrote
    invalid stay, and decode as U+FFFD."""
    # A lead byte among the head's last 3 whose sequence the cut ended early: 110xxxxx wants 2 bytes,
    # 1110xxxx 3, 11110xxx 4.
    for back in range(1, min(3, len(head)) + 1):
        byte = head[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the last character's first byte
            want = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            if want > back:
                head = head[:-back]
            break
    # The tail's leading continuation bytes belong to a character whose start was cut away.
    skip = 0
    while skip < min(3, len(tail)) and tail[skip] & 0xC0 == 0x80:
        skip += 1
    return head, tail[skip:]


def _result(start, output, exit_code, timed_out, error, timeout_s, oom, budget) -> SandboxResult:
    """One result, read the same in every mode and on both paths."""
    head, tail, total = output
    # asyncio reports death by signal N as -N; the shell convention 128+N reads the same in every mode.
    if exit_code is not None and exit_code < 0:
        exit_code = 128 - exit_code
    if timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif oom and exit_code is not None and exit_code != 0:
        # The namespace modes' pid 1 reports its killed child as 128+9 by exit code.
        error = f"out of memory: the runs together used up the sandbox budget ({budget >> 20} MiB)"
    elif exit_code is not None and exit_code > 128 and not error:
        error = f"killed by signal {exit_code - 128} ({_signal_name(exit_code - 128)})"
    truncated = total > len(head) + len(tail)
    if truncated:
        head, tail = _whole_characters(head, tail)
        marker = _MARKER.format(n=total - len(head) - len(tail))
        text = head.decode("utf-8", errors="replace") + marker + tail.decode("utf-8", errors="replace")
    else:
        text = (head + tail).decode("utf-8", errors="replace")
    return SandboxResult(
        output=text,
        exit_code=exit_code,
        timed_out=timed_out,
        truncated=truncated,
        duration_s=time.monotonic() - start,
        error=error,
    )


# THE WARM PATH: a fork server per Sandbox (envs/forkserver.py), in the namespace modes


class _ForkServer:
    """The server process and our end of its socket. Started by a thread of its own that lives as long
    as the server: PR_SET_PDEATHSIG fires when the thread that started a process ends."""

    def __init__(self, mode: str, cgroup_procs: list[str]):
        self.mode = mode
        self.base = _make_base(mode, 0, "")
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.started = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.ready: bool | None = None
        self._ready_lock = threading.Lock()

        def keep() -> None:
            maps, their_maps = socket.socketpair() if _maps_ids(mode) else (None, None)
            try:
                self.proc = subprocess.Popen(
                    _command(mode, self.base, 0, server_fd=theirs.fileno()),
                    cwd=os.path.join(self.base, "run"),
                    env=_env(mode, self.base),
                    stdin=their_maps.fileno() if their_maps else subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                    preexec_fn=functools.partial(_server_preexec, cgroup_procs),
                )
                if maps:
                    their_maps.close()
                    _map_ids(self.proc.pid, maps)
            finally:
                theirs.close()
                for sock in (maps, their_maps):
                    if sock:
                        sock.close()
                self.started.set()
            self.proc.wait()
            self.sock.close()  # the next call's send fails: it goes cold, the next Sandbox call restarts
            shutil.rmtree(self.base, ignore_errors=True)

        threading.Thread(target=keep, daemon=True, name="sandbox-forkserver").start()

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Blocks until the server has imported numpy and sympy and says so."""
        with self._ready_lock:  # two event loops may wait at once; the first reads the message
            if self.ready is None:
                self.started.wait(timeout_s)
                self.sock.settimeout(timeout_s)
                try:
                    self.ready = self.proc is not None and self.sock.recv(16) == b"ready"
                except OSError:
                    self.ready = False
                finally:
                    self.sock.settimeout(None)
                # Its namespaces are made: nothing uses its dir any more, and a process that leaves by
                # os._exit (the rollout process) or SIGKILL would leave it behind.
                shutil.rmtree(self.base, ignore_errors=True)
            return self.ready

    def stop(self) -> None:
        """Kill the server and remove its dir now (at exit no thread is left to do it)."""
        self.started.wait(60)
        if self.proc is not None:
            if self.proc.poll() is None:
                _signal_kill(self.proc)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.base, ignore_errors=True)


def _server_preexec(cgroup_procs: list[str]) -> None:
    confine.die_with_parent(os.getppid())
    _join(cgroup_procs)


def _join(cgroup_procs: list[str]) -> None:
    """Pin to the rollout CPUs and join the sandbox cgroups (in a child, between fork and exec)."""
    confine.pin_to_rollout_cpus()
    for procs in cgroup_procs:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))


async def _pipe_reader(pipe) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader, transport


async def _run_warm(
    server: _ForkServer, code: str, timeout_s: float, max_output_bytes: int, budget: int
) -> SandboxResult | None:
    """One call through the fork server; None if the server did not take it (the caller goes cold)."""
    start = time.monotonic()
    mode = server.mode
    cgroup = confine.memory_cgroup(budget)
    ooms_before = confine.oom_kills(cgroup)
    req = {
        "code": code,
        "timeout_s": timeout_s,
        "uid": random.SystemRandom().randint(*UID_RANGE) if _draws_uid(mode) else None,
        "env": _env(mode, ""),
        "rlimits": confine.rlimits(timeout_s, _nproc(mode)),
    }
    out_r, out_w = os.pipe()
    status_r, status_w = os.pipe()
    try:
        socket.send_fds(server.sock, [json.dumps(req).encode()], [out_w, status_w])
    except OSError:
        os.close(out_r)
        os.close(status_r)
        return None
    finally:
        os.close(out_w)
        os.close(status_w)
    # Closed below however the call ends: a cancel while the output pipe connected left the status
    # pipe open, so the call's process never saw the caller go and ran on until its own timeout.
    pipes = [open(out_r, "rb", 0), open(status_r, "rb", 0)]
    transports = []
    head, tail, total, error = b"", b"", 0, ""
    try:
        out, out_transport = await _pipe_reader(pipes[0])
        transports.append(out_transport)
        status, status_transport = await _pipe_reader(pipes[1])
        transports.append(status_transport)
        drain = asyncio.ensure_future(_drain(out, max_output_bytes))
        try:
            reply = json.loads(await asyncio.wait_for(status.read(), timeout_s + 10) or "{}")
        except (TimeoutError, ValueError):
            reply = {}
        try:
            head, tail, total = await asyncio.wait_for(drain, 2.0)
        except TimeoutError:
            error = "output pipe still open after kill"
    finally:
        for transport in transports:
            transport.close()
        for pipe in pipes:  # what a cancel left unconnected; closing one twice does nothing
            pipe.close()
    if "status" not in reply:
        error = f"sandbox fork server failed the call: {reply.get('error', 'no reply')}"
    oom = confine.oom_kills(cgroup) > ooms_before
    exit_code, timed_out = reply.get("status"), reply.get("timed_out", False)
    return _result(start, (head, tail, total), exit_code, timed_out, error, timeout_s, oom, budget)


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unknown"


class Sandbox:
    """Caps how many runs are live at once (share one per trainer); each run is independent. In the
    namespace modes it runs the code through a fork server of its own (warm: numpy and sympy already
    imported), started on first use; the cold path (`run_python`) is the fallback.

    The cap is a thread semaphore polled from async code, not an asyncio.Semaphore: the rollout worker's
    loop and the trainer's eval loop share one Sandbox from two threads, and an asyncio primitive binds
    to the first loop that waits on it (the other loop's tool calls then raised under contention)."""

    def __init__(
        self, max_concurrency: int = 4, memory_budget_bytes: int = MEMORY_BUDGET_BYTES, warm: bool = True
    ):
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self.memory_budget_bytes = memory_budget_bytes  # one cgroup for all runs with this budget
        self.warm = warm
        self._server: _ForkServer | None = None
        self._server_lock = threading.Lock()
        self._server_failed_at = -1e9  # a server that will not start is retried at most once a minute

    async def _warm_server(self) -> _ForkServer | None:
        with self._server_lock:
            server = self._server
            if server is not None and server.sock.fileno() != -1:
                return server
            if time.monotonic() - self._server_failed_at < 60:
                return None
            server = self._server = _ForkServer(
                isolation_mode(), confine.cgroup_procs(self.memory_budget_bytes)
            )
            weakref.finalize(self, server.stop)  # a Sandbox dropped takes its server with it
        if not await asyncio.to_thread(server.wait_ready):
            await asyncio.to_thread(server.stop)
            self._server_failed_at = time.monotonic()
            return None
        return server

    def close(self) -> None:
        """Stop the fork server (it also dies with this process)."""
        if self._server is not None:
            self._server.stop()

    async def run(
        self,
        code: str,
        timeout_s: float = 10.0,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ) -> SandboxResult:
        while not self._slots.acquire(blocking=False):
            await asyncio.sleep(0.01)  # a run takes ~100 ms: polling costs nothing that matters
        try:
            if self.warm and isolation_mode() in ("root-ns", "user-ns"):
                server = await self._warm_server()
                if server is not None:
                    result = await _run_warm(
                        server, code, timeout_s, max_output_bytes, self.memory_budget_bytes
                    )
                    if result is not None:
                        return result
            return await run_python(code, timeout_s, max_output_bytes, self.memory_budget_bytes)
        finally:
            self._slots.release()
