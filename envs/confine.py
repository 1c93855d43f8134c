"""What confines a process tree besides namespaces: in mode "seccomp" a seccomp filter and a Landlock
file allowlist; in every mode rlimits and one memory cgroup for all sandbox runs (LIMITS below); and
which CPUs the rollout side's processes run on (CPU placement below).

seccomp and Landlock are used by envs/sandbox.py in isolation mode "seccomp" (no mount/pid/net
namespace can be made: root without CAP_SYS_ADMIN in a default Docker container, or a non-root user
without user namespaces).
Both are applied between fork and exec (`confine`, a preexec_fn) after PR_SET_NO_NEW_PRIVS, are
inherited by every descendant and cannot be lifted.

- seccomp (libseccomp through `pyseccomp`): socket() fails (no network, no unix socket to a local
  server; socketpair() still works), ptrace and cross-process memory access fail, signals go only to
  the caller's own process group (kill(0, sig)); io_uring and bpf, which could do the same by another
  door, fail. With `no_fork` (uid 0 where no pids cgroup can be made: nothing else would bound a fork
  bomb), fork, vfork and clone without CLONE_THREAD fail too: threads yes, new processes no.
- Landlock (kernel >= 5.13, plain syscalls): reads and exec only below the given read-only paths,
  writes only below the run dir; /proc, /tmp, home directories and the project checkout are out of
  reach. ABI >= 4 also refuses TCP bind/connect; ABI >= 6 scopes signals to the Landlock domain.
"""

# Imported now, not lazily: it registers an at-fork hook, and asyncio imports it on the first
# run_in_executor. Registered while another thread runs a preexec_fn fork (the sandbox's fork server, an
# answer check), its after-fork release finds a lock its before-fork never took: "RuntimeError: release
# unlocked lock" (reproduced: 1 in 20 runs of a thread forking in a loop beside that first import).
import concurrent.futures.thread  # noqa: F401
import ctypes
import errno
import functools
import glob
import os
import signal

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FILE_ONLY = _EXECUTE | _WRITE_FILE | _READ_FILE | 1 << 14 | 1 << 15  # rights a rule on a file may hold
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

# Syscalls that fail with EPERM in a confined run: network, other processes' memory, signals by
# another door than kill(), and interfaces that can issue the same operations unseen by seccomp.
_DENIED = (
    "socket", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd",
    "pidfd_send_signal", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "io_uring_setup", "bpf", "perf_event_open",
)  # fmt: skip


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.cache
def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is missing or disabled."""
    v = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    return max(v, 0)


_CLONE_THREAD = 0x00010000


@functools.cache
def seccomp_filter(no_fork: bool = False):
    """The filter `confine` loads (built once, in the parent: only seccomp_load runs after fork);
    None if libseccomp or its bindings are missing."""
    try:
        import pyseccomp as sc

        f = sc.SyscallFilter(defaction=sc.ALLOW)
        for name in _DENIED + ("fork", "vfork") * no_fork:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        f.add_rule(sc.ERRNO(errno.EPERM), "kill", sc.Arg(0, sc.NE, 0))
        if no_fork:
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
            f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags in memory: glibc falls back to clone
        return f
    except (ImportError, OSError, RuntimeError):
        return None


def _landlock(readable: list[str], writable: list[str]) -> None:
    abi = landlock_abi()
    handled_fs = (1 << {1: 13, 2: 14, 3: 15}.get(abi, 16)) - 1
    attr = _RulesetAttr(
        fs=handled_fs,
        net=_NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
        scoped=_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0,
    )
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for paths, access in ((readable, _EXECUTE | _READ_FILE | _READ_DIR), (writable, handled_fs)):
            for path in paths:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    allowed = access if os.path.isdir(path) else access & _FILE_ONLY
                    rule = _PathBeneathAttr(allowed_access=allowed & handled_fs, parent_fd=fd)
                    if _libc.syscall(
                        _SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
                    ):
                        raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
                finally:
                    os.close(fd)
        if _libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


def confine(readable: list[str], writable: list[str], no_fork: bool = False) -> None:
    """Confine the calling process and all it will start (preexec_fn). Raises OSError if seccomp
    cannot be loaded; Landlock is applied only where the kernel has it (see `landlock_abi`)."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if landlock_abi():
        _landlock(readable, writable)
    f = seccomp_filter(no_fork)
    if f is None:
        raise OSError(errno.ENOSYS, "no seccomp: libseccomp or pyseccomp missing")
    f.load()


# LIMITS: per process (rlimits, inherited by the whole tree) and, for all runs together, one memory
# budget and one process limit: a cgroup made for this process in the memory and the pids hierarchies
# (one directory in cgroup v2). When the runs together exceed the memory budget the kernel OOM-kills
# inside it, never the trainer or vLLM; past the process limit fork() fails inside it. The pids limit
# is what binds a fork bomb where RLIMIT_NPROC does not: the kernel exempts uid 0 and holders of
# CAP_SYS_RESOURCE or CAP_SYS_ADMIN from it. Where no cgroup can be made (not root, a read-only
# /sys/fs/cgroup without delegation) only RLIMIT_AS bounds memory, and RLIMIT_NPROC processes.
MEMORY_LIMIT_BYTES = 2 * 1024**3  # RLIMIT_AS: address space, generous for numpy/sympy imports
MAX_FILE_BYTES = 16 * 1024**2  # RLIMIT_FSIZE: largest file the code may write
MAX_OPEN_FILES = 128  # RLIMIT_NOFILE
MAX_PIDS = 512  # pids.max: processes and threads of all live runs and the fork server together


def rlimits(timeout_s: float, nproc: int) -> dict[str, tuple[int, int]]:
    """Per process, inherited by the whole tree (RLIMIT_NPROC: per uid)."""
    cpu = int(timeout_s) + 1
    return {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES),
        "RLIMIT_NPROC": (nproc, nproc),
        "RLIMIT_FSIZE": (MAX_FILE_BYTES, MAX_FILE_BYTES),
        "RLIMIT_NOFILE": (MAX_OPEN_FILES, MAX_OPEN_FILES),
        "RLIMIT_CORE": (0, 0),
    }


def _cgroup_dir(controller: str) -> tuple[str, str] | None:
    """(our own cgroup's directory, "v2" or "v1") for `controller`, or None."""
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return f"/sys/fs/cgroup/{controllers}" + path, "v1"
        if controllers == "":
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):  # pure v2; hybrid
                controllers = os.path.join(root, "cgroup.controllers")
                if os.path.exists(controllers) and controller in open(controllers).read().split():
                    return root + path, "v2"
    return None


# What each controller's limit is written to: (v2 file, v1 file), then the optional swap limit's.
_LIMITS = {
    "memory": (("memory.max", "memory.limit_in_bytes"), ("memory.swap.max", "memory.memsw.limit_in_bytes")),
    "pids": (("pids.max", "pids.max"), None),
}


@functools.cache
def _sandbox_cgroup(controller: str, budget_bytes: int) -> tuple[str, str] | None:
    """(directory, version) of this process's cgroup for sandbox runs with `budget_bytes` in the
    hierarchy of `controller`, made on first use; None where none can be made. Cgroups left by dead
    processes (a SIGKILLed trainer) are removed here."""
    try:
        found = _cgroup_dir(controller)
        if found is None:
            return None
        parent, version = found
        for old in glob.glob(os.path.join(parent, "sandbox-*-*")):
            pid = os.path.basename(old).split("-")[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(old)  # a cgroup with no process left goes with rmdir, its files and all
                except OSError:
                    pass
        if version == "v2":
            # Children get the controller only if our cgroup holds no process of its own (or is the root).
            with open(os.path.join(parent, "cgroup.subtree_control"), "r+") as f:
                if controller not in f.read().split():
                    f.write(f"+{controller}")
                    f.flush()
        d = os.path.join(parent, f"sandbox-{os.getpid()}-{budget_bytes >> 20}m")
        os.makedirs(d, exist_ok=True)
        limit, swap = _LIMITS[controller]
        value = budget_bytes if controller == "memory" else MAX_PIDS
        _write(d, limit[version == "v1"], value)
        if swap:
            _write(d, swap[version == "v1"], 0 if version == "v2" else value, missing_ok=True)
        return d, version
    except OSError:
        return None


def memory_cgroup(budget_bytes: int) -> tuple[str, str] | None:
    """(directory, version) of the memory cgroup of sandbox runs with `budget_bytes`; None where none
    can be made (then only RLIMIT_AS bounds memory)."""
    return _sandbox_cgroup("memory", budget_bytes)


def pids_cgroup(budget_bytes: int) -> tuple[str, str] | None:
    """(directory, version) of the pids cgroup of sandbox runs with `budget_bytes`, or None."""
    return _sandbox_cgroup("pids", budget_bytes)


def cgroup_procs(budget_bytes: int) -> list[str]:
    """The cgroup.procs files a sandbox run's first process writes its pid to: the memory budget and
    the process limit (one file in cgroup v2, two in v1; none where no cgroup can be made)."""
    dirs = {c[0] for c in (_sandbox_cgroup(k, budget_bytes) for k in _LIMITS) if c is not None}
    return sorted(os.path.join(d, "cgroup.procs") for d in dirs)


def _write(d: str, name: str, value: int, missing_ok: bool = False) -> None:
    try:
        with open(os.path.join(d, name), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def oom_kills(cgroup: tuple[str, str] | None) -> int:
    """How many processes the kernel has OOM-killed in the cgroup so far."""
    if cgroup is None:
        return 0
    name = "memory.events" if cgroup[1] == "v2" else "memory.oom_control"
    try:
        for line in open(os.path.join(cgroup[0], name)):
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# CPU placement: the rollout side's processes stay off the trainer's cores. The trainer (--rollout-cpus)
# names the CPUs in the environment; the rollout thread pins itself, and every tool or reward process
# pins itself between fork and exec, whichever thread started it (the eval at start-up runs on the
# trainer's thread, and a fork server or answer-checking worker it starts serves the whole run).
ROLLOUT_CPUS_ENV = "ASYNC_GRPO_ROLLOUT_CPUS"


def parse_cpus(spec: str) -> set[int]:
    """'0', '2-5,7' → {0}, {2, 3, 4, 5, 7} (taskset's list syntax); ValueError on anything else."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus or min(cpus) < 0:
        raise ValueError(spec)
    return cpus


def pin_to_rollout_cpus() -> None:
    """Move the calling thread (in a child between fork and exec: the whole process) onto the CPUs in
    $ASYNC_GRPO_ROLLOUT_CPUS; nothing when unset. Linux affinity is per thread and inherited by the
    threads and processes it starts."""
    spec = os.environ.get(ROLLOUT_CPUS_ENV)
    if spec:
        os.sched_setaffinity(0, parse_cpus(spec))


def die_with_parent(parent_pid: int) -> bool:
    """SIGKILL this process when the thread that started it exits (a kill -9 of the trainer included);
    False if that parent is already gone (it died before the request took effect): then return at once."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent_pid
