"""The sandbox's warm path: a fork server with numpy and sympy imported, one forked child per call.

envs/sandbox.py starts it as the last step of the namespace modes' set-up, in place of the code:
`python -I -c <this file's text> FD HIDDEN`, inside the pid, net and mount namespaces and the minimal
root, as their root (it imports nothing from the project: the checkout is not visible in there). FD is
a SOCK_SEQPACKET socket: each message is one call, a JSON request with two file descriptors attached,
the write ends of the call's output pipe and of its status pipe. HIDDEN (JSON) names what of the
minimal root lies below /tmp or /dev/shm (binds of a Python install in a temp dir, symlinks to it),
which each call's fresh tmpfs would hide: the call puts it back.

Per call (the same limits and the same clean state as a cold run):
  server ─fork─► A: new mount + pid namespace; fresh tmpfs at /sandbox (the cwd, with main.py), /tmp
                 and /dev/shm (HIDDEN moved back in, read-only as it was); waits for B with the
                 wall-clock deadline, SIGKILLs it past that or once the caller closed the status
                 pipe (a cancelled call), and writes {"status", "timed_out"} to the status pipe
     A ─fork─► B: pid 1 of the call's pid namespace: its own /proc, stdout/stderr to the output pipe,
                 rlimits, drops privileges (to the drawn uid where there is one, as in root-ns and in
                 user-ns under a root trainer; else every capability), fresh
                 numpy seed, then runs main.py as __main__. Its exit takes every process the code
                 left behind with it (as pid 1, it ignores signals it sends itself without a handler)
Nothing of a call outlives it: variables, monkeypatched modules and threads die with B's memory, files
with A's tmpfs. Two forks per call, not three: each copies the page tables of a heap holding sympy.
"""

import atexit
import ctypes
import errno
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
import threading
import traceback
import types

import numpy  # noqa: F401  the point of the warm path: imported once, shared by every fork
import numpy.random  # numpy imports it lazily; the children reseed it
import sympy  # noqa: F401

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWIPC = 0x00020000, 0x20000000, 0x08000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE, MS_REC = 2, 4, 8, 4096, 8192, 16384
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24


def check(ret: int, what: str) -> None:
    if ret != 0:
        raise OSError(ctypes.get_errno(), what)


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    check(
        libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()), f"mount {target}"
    )


def drop_privileges(uid: int | None) -> None:
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # clears every capability
        return
    # user-ns as a plain user: we are the namespace's only uid; having no capability makes it harmless.
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


def run_code(req: dict, out_fd: int) -> None:
    """B: never returns."""
    code = 1
    atexit._clear()  # the server's callbacks, not the code's: never run here
    try:
        # A session of its own: in A's process group, kill(0, sig) reached A (outside our pid namespace,
        # and of our uid where there is no drawn one), which keeps the deadline.
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for name, value in req["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value[0], value[1]))
        os.chdir("/sandbox")
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "")  # of the call's pid namespace
        drop_privileges(req["uid"])
        os.environ.clear()
        os.environ.update(req["env"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        numpy.random.seed()  # `random` reseeds itself after fork; numpy's legacy global state does not
        sys.argv = ["main.py"]
        main = types.ModuleType("__main__")
        main.__file__ = "/sandbox/main.py"  # as `python main.py` has it (and its tracebacks say)
        sys.modules["__main__"] = main
        source = open("main.py", encoding="utf-8", errors="replace").read()
        code = 0
        exec(compile(source, main.__file__, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): the message, after what the code printed, and status 1
            _flush(sys.stdout)
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        code = 1
        tb = e.__traceback__.tb_next if e.__traceback__ else None  # not this function's frame
        # stdout is block-buffered into the pipe stderr shares: the traceback came before the prints
        _flush(sys.stdout)
        traceback.print_exception(type(e), e, tb)
    finally:
        # The end of `python main.py`: its output flushed once the code is done (a run killed while
        # a thread holds it on still says what it printed), then (Py_FinalizeEx) the code's non-daemon
        # threads waited for and its atexit callbacks run. os._exit alone dropped both.
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
        try:
            threading._shutdown()
        except BaseException:  # interrupted: the callbacks all the same, as the interpreter does
            pass
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
        os._exit(code & 0xFF)


def _flush(stream) -> None:
    try:
        stream.flush()
    except BaseException:  # the code closed or replaced it
        pass


def mkdirs(path: str) -> None:
    """mkdir -p, each new directory 755 whatever the umask (the code's uid must pass through)."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        if not os.path.isdir(d):
            os.mkdir(d)
            os.chmod(d, 0o755)


def fresh_tmpfs(hidden: dict) -> None:
    """A fresh tmpfs at /sandbox, /tmp and /dev/shm, with the binds in `hidden` moved from below the
    old ones to below the new (by way of /sandbox) and its symlinks made again. 64 MiB each: the disk
    cap of every run (envs/confine.py: MAX_DIR_BYTES; this file imports nothing of the project)."""
    mount("tmpfs", "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    binds = [(p, f"/sandbox/{i}", os.path.isdir(p)) for i, p in enumerate(hidden["binds"])]
    for path, hold, is_dir in binds:
        os.mkdir(hold) if is_dir else open(hold, "w").close()
        mount(path, hold, "", MS_BIND | MS_REC, "")  # keeps its flags: read-only stays read-only
    for path in ("/tmp", "/dev/shm"):
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    for path, hold, is_dir in binds:
        mkdirs(path if is_dir else os.path.dirname(path))
        if not is_dir:
            open(path, "w").close()
        mount(hold, path, "", MS_MOVE, "")
        os.rmdir(hold) if is_dir else os.unlink(hold)
    for link, target in hidden["links"].items():
        mkdirs(os.path.dirname(link))
        os.symlink(target, link)


def call(req: dict, out_fd: int, status_fd: int, hidden: dict) -> None:
    """A: never returns."""
    status, timed_out = -1, False
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        # IPC too: SysV segments and queues, POSIX mqueues outlive their process; this namespace, not.
        check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
        uid = req["uid"] if req["uid"] is not None else 0
        fresh_tmpfs(hidden)
        os.chown("/sandbox", uid, uid)
        with open("/sandbox/main.py", "w", encoding="utf-8", errors="replace") as f:
            f.write(req["code"])
        try:
            b = os.fork()
        except OSError as e:
            raise RuntimeError(fork_failure(e)) from None
        if b == 0:  # B
            os.close(status_fd)
            run_code(req, out_fd)
        os.close(out_fd)
        poll = select.poll()
        poll.register(pidfd := os.pidfd_open(b), select.POLLIN)
        poll.register(status_fd, 0)  # POLLERR once the caller closed its end: it gave up the call
        events = poll.poll(int(req["timeout_s"] * 1000))
        timed_out = not events
        if pidfd not in [fd for fd, _ in events]:
            os.kill(b, signal.SIGKILL)
        status = os.waitstatus_to_exitcode(os.waitpid(b, 0)[1])
    except BaseException as e:
        error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        try:
            os.write(status_fd, json.dumps({"error": error}).encode())
        finally:
            os._exit(1)
    try:
        os.write(status_fd, json.dumps({"status": status, "timed_out": timed_out}).encode())
    finally:  # a caller that gave up has closed its end: EPIPE
        os._exit(0)


def fork_failure(e: OSError) -> str:
    """A call's error when no process could be forked for it."""
    if e.errno == errno.EAGAIN:  # pids.max of the sandbox cgroup, or RLIMIT_NPROC
        return "no process could be started (process limit reached: other runs hold every process)"
    return f"no process could be started ({e.strerror})"


def serve(fd: int, hidden: dict) -> None:
    # The imports' objects move to a generation the collector never scans: a collection in a call
    # would otherwise touch every one of them and copy the whole heap page by page (copy-on-write).
    gc.freeze()
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the calls
    sock.send(b"ready")
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not msg:
            return  # the trainer closed its end: we exit, and the namespaces die with us
        if len(fds) != 2:
            for f in fds:
                os.close(f)
            continue
        try:
            pid = os.fork()
        except OSError as e:  # the pids cgroup is full (other calls' fork bombs): this call fails, not us
            try:
                os.write(fds[1], json.dumps({"error": fork_failure(e)}).encode())
            except OSError:  # a caller that gave up
                pass
            pid = -1
        if pid == 0:
            sock.close()
            call(json.loads(msg), *fds, hidden)
        for f in fds:
            os.close(f)


if __name__ == "__main__":
    serve(int(sys.argv[1]), json.loads(sys.argv[2]))
