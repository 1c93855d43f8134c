"""Confinement of one process tree without namespaces: a seccomp filter and a Landlock file allowlist.

Used by envs/sandbox.py in isolation mode "seccomp" (no mount/pid/net namespace can be made: root
without CAP_SYS_ADMIN in a default Docker container, or a non-root user without user namespaces).
Both are applied between fork and exec (`confine`, a preexec_fn) after PR_SET_NO_NEW_PRIVS, are
inherited by every descendant and cannot be lifted.

- seccomp (libseccomp through `pyseccomp`): socket() fails (no network, no unix socket to a local
  server; socketpair() still works), ptrace and cross-process memory access fail, signals go only to
  the caller's own process group (kill(0, sig)); io_uring and bpf, which could do the same by another
  door, fail.
- Landlock (kernel >= 5.13, plain syscalls): reads and exec only below the given read-only paths,
  writes only below the run dir; /proc, /tmp, home directories and the project checkout are out of
  reach. ABI >= 4 also refuses TCP bind/connect; ABI >= 6 scopes signals to the Landlock domain.
"""

import ctypes
import errno
import functools
import os

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_NO_NEW_PRIVS = 38
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


@functools.cache
def seccomp_filter():
    """The filter `confine` loads (built once, in the parent: only seccomp_load runs after fork);
    None if libseccomp or its bindings are missing."""
    try:
        import pyseccomp as sc

        f = sc.SyscallFilter(defaction=sc.ALLOW)
        for name in _DENIED:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        f.add_rule(sc.ERRNO(errno.EPERM), "kill", sc.Arg(0, sc.NE, 0))
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


def confine(readable: list[str], writable: list[str]) -> None:
    """Confine the calling process and all it will start (preexec_fn). Raises OSError if seccomp
    cannot be loaded; Landlock is applied only where the kernel has it (see `landlock_abi`)."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if landlock_abi():
        _landlock(readable, writable)
    f = seccomp_filter()
    if f is None:
        raise OSError(errno.ENOSYS, "no seccomp: libseccomp or pyseccomp missing")
    f.load()


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
