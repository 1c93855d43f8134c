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
  the caller's own process group (kill(0, sig)), a file's owner cannot be set (below); io_uring and
  bpf, which could do the same by another door, fail. With `no_fork` (uid 0 where no pids cgroup can
  be made: nothing else would bound a fork bomb), fork, vfork and clone fail too: no new process and
  no thread. Nothing else would bound threads either (uid 0 is exempt from RLIMIT_NPROC): with
  threads allowed, 11,000 were started in 3 s, a third of this machine's pid_max, and a watcher that
  killed the run past 256 was too late under load (600 of 600 started). Python says "can't start new
  thread"; numpy runs single-threaded there anyway (OPENBLAS_NUM_THREADS=1).
- Landlock (kernel >= 5.13, plain syscalls), best effort as the kernel's documentation describes: the
  rights of the ABI the kernel reports (`landlock_rights`), and a ruleset it refuses retried with those
  of the ABI before (`landlock_ruleset_rights`). Reads and exec only below the given read-only paths,
  writes only below the run dir; /proc, /tmp, home directories and the project checkout are out of
  reach. ABI >= 4 also refuses TCP bind/connect; ABI >= 6 scopes signals and abstract unix sockets to
  the Landlock domain.
- Where no pid namespace hides the trainer, a signal can also reach it by way of a file's owner
  (fcntl F_SETOWN + F_SETSIG + O_ASYNC on a pipe, FIOSETOWN on a socketpair): the kernel then signals
  a process of the same uid, or anyone when the caller's euid is 0. seccomp refuses every way of
  setting that owner, whatever the Landlock ABI.
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
import shutil
import signal
import sys
import tempfile
import time

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FILE_ONLY = _EXECUTE | _WRITE_FILE | _READ_FILE | 1 << 14 | 1 << 15  # rights a rule on a file may hold
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
# What each ABI brought, from the kernel's include/uapi/linux/landlock.h: ABI 1 the filesystem rights
# 0-12 (EXECUTE .. MAKE_SYM), 2 REFER (13), 3 TRUNCATE (14), 4 TCP bind/connect (network rules: no new
# filesystem right), 5 IOCTL_DEV (15), 6 the scopes, 7 only logging flags of landlock_restrict_self
# (left at their defaults here). A newer ABI is used as the newest we know.
LANDLOCK_NEWEST_ABI = 7
_FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
_NAMES = {  # for the start-up line
    "filesystem": "execute write_file read_file read_dir remove_dir remove_file make_char make_dir "
    "make_reg make_sock make_fifo make_block make_sym refer truncate ioctl_dev",
    "network": "bind_tcp connect_tcp",
    "scopes": "abstract_unix_socket signal",
}
# fcntl commands and ioctl requests that set the process a file signals (<asm-generic/fcntl.h>,
# <asm-generic/sockios.h>). The kernel reads both as 32-bit: rules compare the low 32 bits only.
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902

# Syscalls that fail with EPERM in a confined run: network, other processes' memory, signals by
# another door than kill(), and interfaces that can issue the same operations unseen by seccomp.
_DENIED = (
    "socket", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd",
    "pidfd_send_signal", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "io_uring_setup", "bpf", "perf_event_open",
    # System V IPC and POSIX message queues: kernel objects that outlive the run (no IPC namespace
    # here), in no run dir, and shared by key with the next run.
    "shmget", "msgget", "semget", "mq_open",
)  # fmt: skip


# Syscalls whose first argument names another process (0: the caller): refused for any other.
_OTHER_PROCESS_BY_PID = (
    "prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
    "migrate_pages", "move_pages",
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


def landlock_rights(abi: int) -> tuple[int, int, int]:
    """(filesystem rights, network rights, scopes) that Landlock `abi` knows; nothing at ABI 0."""
    abi = min(abi, LANDLOCK_NEWEST_ABI)
    if abi < 1:
        return 0, 0, 0
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    return _FS_RIGHTS[min(abi, 5)], net, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0


def _create_ruleset(fs: int, net: int, scoped: int) -> int:
    """A ruleset's fd, or -errno. The attribute is only as long as its last field in use: a kernel
    older than the field refuses a longer one (E2BIG)."""
    attr = _RulesetAttr(fs=fs, net=net, scoped=scoped)
    size = 24 if scoped else 16 if net else 8
    fd = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    return fd if fd >= 0 else -ctypes.get_errno()


@functools.cache
def landlock_ruleset_rights() -> tuple[int, int, int, int, int]:
    """(ABI reported, ABI whose rights are applied, filesystem rights, network rights, scopes): the
    rights of the reported ABI, or, where the kernel refuses a ruleset with them (one that reports an
    ABI without all it brings: RHEL 9 is said to report 6 without the signal scope), those of the newest
    older ABI it accepts; applied ABI 0 where it accepts none (then Landlock is not applied). Probed in
    the parent, with rulesets that restrict nothing: a preexec_fn only reads the answer."""
    abi = landlock_abi()
    for applied in range(min(abi, LANDLOCK_NEWEST_ABI), 0, -1):
        rights = landlock_rights(applied)
        fd = _create_ruleset(*rights)
        if fd >= 0:
            os.close(fd)
            return abi, applied, *rights
        if fd not in (-errno.EINVAL, -errno.E2BIG):  # not "unknown right or field": older won't help
            break
    return abi, 0, 0, 0, 0


def landlock_description() -> str:
    """What `confine` applies of Landlock here, in words (the start-up line)."""
    abi, applied, *rights = landlock_ruleset_rights()
    if not applied:
        return f"Landlock ABI {abi}: not applied" + (" (no ruleset accepted)" if abi else "")
    parts = []
    for (kind, names), bits in zip(_NAMES.items(), rights, strict=True):
        named = [n for i, n in enumerate(names.split()) if bits >> i & 1]
        if len(named) > 2:  # the filesystem rights: always the first N
            named = [f"{bits:#x} ({len(named)} rights: {named[0]} .. {named[-1]})"]
        parts.append(f"{kind} {'+'.join(named) or 'none'}")
    retried = f" (refused its rights; those of ABI {applied} applied)" if applied != abi else ""
    return f"Landlock ABI {abi}{retried}: " + ", ".join(parts)


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
        # Another process's limits, priority, scheduling and memory placement (pid 0 is the caller):
        # where the code's uid is ours (a plain user; root without capabilities) prlimit64 set the
        # trainer's RLIMIT_CPU to 1 s (the kernel SIGKILLed it) and setpriority(PRIO_USER) reniced it.
        for name in _OTHER_PROCESS_BY_PID:
            f.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.NE, 0))
        for name, self_only in (("setpriority", 0), ("ioprio_set", 1)):  # PRIO_PROCESS, IOPRIO_WHO_PROCESS
            f.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(0, sc.NE, self_only))
            f.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(1, sc.NE, 0))
        owner = {"fcntl": (_F_SETOWN, _F_SETSIG, _F_SETOWN_EX), "ioctl": (_FIOSETOWN, _SIOCSPGRP)}
        for name, values in owner.items():
            for v in values:
                f.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, v))
        if no_fork:
            f.add_rule(sc.ERRNO(errno.EPERM), "clone")  # threads too: see the module docstring
            f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags in memory: glibc falls back to clone
        return f
    except (ImportError, OSError, RuntimeError):
        return None


def _landlock(readable: list[str], writable: list[str]) -> None:
    _, applied, handled_fs, net, scoped = landlock_ruleset_rights()
    if not applied:
        return
    ruleset = _create_ruleset(handled_fs, net, scoped)
    if ruleset < 0:
        raise OSError(-ruleset, "landlock_create_ruleset failed")
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
    cannot be loaded; Landlock is applied only where the kernel has it (see `landlock_ruleset_rights`)."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    _landlock(readable, writable)
    f = seccomp_filter(no_fork)
    if f is None:
        raise OSError(errno.ENOSYS, "no seccomp: libseccomp or pyseccomp missing")
    f.load()


# WHAT THE CODE MAY READ: the system paths and the Python install, bound read-only into the namespace
# modes' minimal root (envs/sandbox.py) and Landlock's read rules in mode "seccomp".
# Besides the Python install: binaries, shared libraries, the loader's cache.
SYSTEM_PATHS = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache"]


def blocked_ancestors(path: str) -> dict[str, set[str]]:
    """Ancestors of `path` that others cannot traverse, each with the child on the way to `path`."""
    blocked: dict[str, set[str]] = {}
    parts = os.path.realpath(path).split(os.sep)[1:]
    for i in range(len(parts)):  # every directory on the way, the path's own parent included
        parent = os.sep + os.sep.join(parts[:i])
        if not os.stat(parent).st_mode & 0o001:
            blocked.setdefault(parent, set()).add(parts[i])
    return blocked


def _resolve(path: str, links: dict[str, str]) -> str:
    """The real path of `path`, recording every symlink met on the way (link -> target) in `links`."""
    todo, cur = [p for p in path.split("/") if p], "/"
    for _ in range(1000):  # symlink loops end here
        if not todo:
            return cur
        nxt = os.path.normpath(os.path.join(cur, todo.pop(0)))
        if os.path.islink(nxt):
            target = os.readlink(nxt)
            links[nxt] = target
            todo = [p for p in target.split("/") if p] + todo
            cur = "/" if target.startswith("/") else cur
        else:
            cur = nxt
    raise OSError(f"too many symlinks in {path}")


@functools.cache
def visible_paths() -> tuple[list[str], dict[str, str]]:
    """(real directories and files the code may read, symlinks leading to them): the system paths and
    the Python install (interpreter, its prefix, the venv)."""
    links: dict[str, str] = {}
    wanted = SYSTEM_PATHS + [sys.executable, sys.prefix, sys.base_prefix]
    real = sorted({_resolve(p, links) for p in wanted if os.path.exists(p)})
    binds = [p for p in real if not any(p.startswith(q.rstrip("/") + "/") for q in real if q != p)]
    inside = [q.rstrip("/") + "/" for q in binds]
    return binds, {k: v for k, v in links.items() if not any(k.startswith(q) for q in inside)}


def python_reachable_by_others() -> bool:
    return not any(blocked_ancestors(p) for p in (sys.executable, sys.prefix, sys.base_prefix))


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
# The disk a run may fill: the size of the namespace modes' tmpfs at /sandbox (and of their /tmp and
# /dev/shm, each its own; envs/forkserver.py's too); elsewhere what `dir_bytes` and `deleted_bytes` may
# find (the watcher in envs/sandbox.py kills the run past it): RLIMIT_FSIZE bounds each file, not how many.
MAX_DIR_BYTES = 64 * 1024**2
MAX_DIR_ENTRIES = 10_000  # more files and dirs than that in a run dir count as over MAX_DIR_BYTES


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
    "cpuset": (("cpuset.cpus", "cpuset.cpus"), None),
}


@functools.cache
def _sandbox_cgroup(controller: str, budget_bytes: int, cpus: str = "") -> tuple[str, str] | None:
    """(directory, version) of this process's cgroup for sandbox runs with `budget_bytes` in the
    hierarchy of `controller` (cpuset: on `cpus`), made on first use; None where none can be made.
    Cgroups left by dead processes (a SIGKILLed trainer) are removed here."""
    try:
        found = _cgroup_dir(controller)
        if found is None:
            return None
        parent, version = found
        namespace = pid_namespace()
        for old in glob.glob(os.path.join(parent, "sandbox-*-*")):
            if left_by_a_dead_process(os.path.basename(old), namespace):
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
        d = os.path.join(parent, f"sandbox-{owner_tag()}-{budget_bytes >> 20}m")
        os.makedirs(d, exist_ok=True)
        limit, swap = _LIMITS[controller]
        value = {"memory": budget_bytes, "pids": MAX_PIDS, "cpuset": cpus}[controller]
        if controller == "cpuset" and version == "v1":  # takes no process until its memory nodes are set
            _write(d, "cpuset.mems", open(os.path.join(parent, "cpuset.mems")).read().strip())
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


def cpuset_cgroup(budget_bytes: int) -> tuple[str, str] | None:
    """(directory, version) of the cpuset cgroup of sandbox runs with `budget_bytes` on the rollout
    CPUs ($ASYNC_GRPO_ROLLOUT_CPUS), or None (unset, or none can be made). The runs pin themselves to
    those CPUs (`pin_to_rollout_cpus`), but the code may widen its own affinity; a cpuset it cannot."""
    spec = os.environ.get(ROLLOUT_CPUS_ENV)
    cpus = ",".join(map(str, sorted(parse_cpus(spec)))) if spec else ""  # the kernel's list syntax
    return _sandbox_cgroup("cpuset", budget_bytes, cpus) if cpus else None


def cgroup_procs(budget_bytes: int) -> list[str]:
    """The cgroup.procs files a sandbox run's first process writes its pid to: the memory budget, the
    process limit and, with rollout CPUs, their cpuset (one file in cgroup v2, one each in v1; none
    where no cgroup can be made)."""
    found = [memory_cgroup(budget_bytes), pids_cgroup(budget_bytes), cpuset_cgroup(budget_bytes)]
    return sorted({os.path.join(c[0], "cgroup.procs") for c in found if c is not None})


def _write(d: str, name: str, value: int | str, missing_ok: bool = False) -> None:
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


def become_subreaper() -> None:
    """Orphans below the calling process come to it, not to init (in a child between fork and exec:
    kept across exec, not inherited by its children)."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


# FINDING A RUN'S PROCESSES: without a pid namespace nothing the kernel does kills them for us.


def _process_table() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (state, parent pid, process group, uid) of every process."""
    table = {}
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit():
                state, ppid, pgrp = _stat(int(pid))[:3]
                table[int(pid)] = (state, int(ppid), int(pgrp), os.stat(f"/proc/{pid}").st_uid)
        except (OSError, IndexError, ValueError):  # exited meanwhile
            pass
    return table


def _run_processes(table: dict, first: int, uid: int | None) -> set[int]:
    """`first`, its descendants, its process group and every process of its drawn `uid`."""
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    run, todo = {first}, [first]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in run:
                run.add(child)
                todo.append(child)
    return run | {pid for pid, (_, _, pgrp, owner) in table.items() if pgrp == first or owner == uid}


def kill_run(first: int, uid: int | None, spare_init: bool = False) -> dict[int, str]:
    """SIGKILL every process of a run but its first process `first` (whose pid is its process group):
    the descendants of `first` (a subreaper: a setsid() or double-fork daemon of the run comes back to
    it, not to init), its process group, and every process of its drawn `uid`. Returns each with its
    state before the kill ("Z": a zombie, gone with its reaper). `first` goes last, once none is left
    alive: killed before, it would hand what is left to init. `spare_init`: nor the child of `first`
    that is pid 1 of the run's pid namespace (`unshare --fork`'s: it exits once the code is dead)."""
    table = _process_table()
    run = _run_processes(table, first, uid) - {first}
    if spare_init:
        run -= {pid for pid in run if table[pid][1] == first and _namespace_pid(pid) == 1}
    # Their process groups first, each in one call that a fork cannot slip past (a fork bomb): a group
    # lies within the session it was made in, and every session here is the run's but `first`'s own.
    for kill, ids in ((os.killpg, {table[pid][2] for pid in run} - {first}), (os.kill, run)):
        for i in ids:
            try:
                kill(i, signal.SIGKILL)
            except OSError:
                pass
    return {pid: table[pid][0] for pid in run}


def kill_until_gone(first: int, uid: int | None, deadline: float, spare_init: bool = False) -> dict[int, str]:
    """kill_run until none of the run but `first` is left alive (a fork bomb: a few rounds) or the
    monotonic `deadline`, sleeping between rounds (blocking: envs/sandbox.py's loop has its own
    awaiting copy); what the last round found."""
    while set((left := kill_run(first, uid, spare_init)).values()) - {"Z"} and time.monotonic() < deadline:
        time.sleep(0.005)
    return left


def dir_bytes(run_dir: str, max_entries: int = MAX_DIR_ENTRIES) -> int | None:
    """The disk the files and dirs below `run_dir` take (allocated blocks: a sparse file counts what it
    holds), each inode once; None where that cannot be told: a dir the code made unreadable to us, or
    more than `max_entries` entries (empty files take inodes and time to count). One that vanishes as
    we look (the code deleted it) counts nothing."""
    total, seen, todo = 0, set(), [run_dir]
    while todo:
        try:
            with os.scandir(todo.pop()) as entries:
                for entry in entries:
                    if len(seen) >= max_entries:
                        return None
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return total


def fs_used(path: str) -> int | None:
    """Bytes in use on the filesystem holding `path` (everyone's: one statfs call, ~1 µs); None where
    it cannot be told. ext4, xfs and tmpfs (and overlayfs on them) count a write as it happens, delayed
    allocation included."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def deleted_bytes(first: int, uid: int | None) -> int | None:
    """The disk that files deleted while still open or mapped take, held by the processes of a run
    (`_run_processes`: `first`, its descendants, its process group and its drawn `uid`): gone
    from its dir, not from the disk. None where a process's files cannot be read (it made itself
    non-dumpable). memfds are memory (the memory cgroup's), not disk."""
    run = _run_processes(_process_table(), first, uid)
    sizes: dict[tuple[int, int], int] = {}
    for pid in run:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.endswith(" (deleted)") and not target.startswith("/memfd:"):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        sizes[st.st_dev, st.st_ino] = st.st_blocks * 512
                except FileNotFoundError:  # closed meanwhile
                    pass
            # A mapping outlives its fd: "start-end perms offset dev inode path (deleted)"; what is
            # mapped, up to RLIMIT_FSIZE, is the most of the file it can have written.
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if line.endswith(" (deleted)\n") and " /memfd:" not in line:
                        span, _, offset, dev, inode = line.split(maxsplit=5)[:5]
                        lo, hi = (int(x, 16) for x in span.split("-"))
                        major, minor = (int(x, 16) for x in dev.split(":"))
                        key = (os.makedev(major, minor), int(inode))  # as the fd's stat has it
                        sizes[key] = max(sizes.get(key, 0), int(offset, 16) + hi - lo)
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        except OSError:
            if exiting(pid):  # a process on its way out refuses these reads, and holds nothing for long
                continue
            return None
    return sum(sizes.values())


def exiting(pid: int) -> bool:
    """Has `pid` exited (a zombie, on its way out, or gone)?"""
    try:
        return _stat(pid)[0] in "ZXx"
    except (OSError, IndexError):
        return True


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the name (state, parent pid, process group, ...): the name is
    the code's to choose, ")" included."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _namespace_pid(pid: int) -> int | None:
    """`pid`'s id in its own (innermost) pid namespace; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[-1]) for line in f if line.startswith("NSpid:")), None)
    except (OSError, ValueError):
        return None


def user_process_count() -> int:
    """How many processes our uid has (RLIMIT_NPROC counts them)."""
    return sum(owner == os.getuid() for _, _, _, owner in _process_table().values())


def remove_tree(path: str) -> None:
    """shutil.rmtree, after giving us back every dir below `path`: code running as our uid (a plain
    user in mode seccomp) may have made one unreadable or read-only (chmod 0), which rmtree then
    skipped, leaving its files on the disk for good. Only once the run's processes are gone."""
    todo = [path]
    while todo:
        d = todo.pop()
        try:
            os.chmod(d, 0o700)
            with os.scandir(d) as entries:
                todo += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


@functools.cache
def remove_run_dirs_of_dead_processes() -> None:
    """Each run removes its own dir, but a SIGKILLed trainer leaves those of its live runs (the runs
    die with it, by PR_SET_PDEATHSIG; nobody is left to clean up). Run dirs are named after the process
    that made them (`owner_tag`), and the first run of every process removes those of dead ones."""
    namespace = pid_namespace()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "sandbox-*-*")):
        if left_by_a_dead_process(os.path.basename(path), namespace):
            remove_tree(path)


def pid_namespace() -> int:
    """The id of our pid namespace (the inode of /proc/self/ns/pid)."""
    return os.stat("/proc/self/ns/pid").st_ino


def owner_tag() -> str:
    """What the names of our run dirs and sandbox cgroups start with after "sandbox-": our pid and our
    pid namespace. A pid alone did not tell the dead: a process in a pid namespace of its own (an
    `unshare --pid` shell, a container sharing /tmp or the cgroup tree) could not see ours, and
    removed the dirs of our runs in progress and our cgroups, which our next run then failed to join."""
    return f"{os.getpid()}-{pid_namespace()}"


def left_by_a_dead_process(name: str, namespace: int) -> bool:
    """Is `name` ("sandbox-{owner_tag}-...") that of a process of our pid namespace (`namespace`, read
    once by the caller's loop) that is gone?"""
    parts = name.split("-")
    if len(parts) < 4 or not parts[1].isdigit() or parts[2] != str(namespace):
        return False
    pid = parts[1]
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        pass
    return False
