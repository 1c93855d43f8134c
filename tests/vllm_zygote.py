"""The test sessions' vLLM launcher: one interpreter that imports vLLM once and forks a server per request.

A server's start-up on 2 cores is ~11 s of CPU, ~10 of them importing vLLM; forked from this process,
which has imported it, a server is healthy ~3.5 s after the fork. The suite starts a dozen servers of its
own (tests/conftest.py `start_server`), each an import saved on a machine whose CPU is what bounds it.

    python tests/vllm_zygote.py SOCKET   # listens on the unix socket SOCKET; at EOF on its stdin it
                                         # kills its servers and exits (the session's watchdog)

Protocol, one connection per server: the client sends one JSON line {cmd, env, cwd, log}, `cmd` being
what `vllm_server.start_vllm_server` built for a one-rank CPU server (`[taskset -c CPUS] python -c
FORKED_ENGINE_CORE ARGS`); it reads back the child's pid, then its exit status, a line each. The child is
a session of its own (its pgid is its pid, as a Popen'd server's) and runs vLLM's API server module as
`python -m` would, with the command's arguments, environment and CPUs, writing to `log`. Forking after
the import is what that server does already (FORKED_ENGINE_CORE: its API process forks the engine core).
"""

import json
import multiprocessing
import os
import runpy
import selectors
import signal
import socket
import sys
import tempfile
import traceback

from envs.confine import parse_cpus

API_SERVER = "vllm.entrypoints.openai.api_server"


def server_args(cmd: list[str]) -> tuple[set[int] | None, list[str]]:
    """(CPUs or None, the API server's arguments) of a command start_vllm_server built."""
    cpus = None
    if cmd[0] == "taskset":
        cpus, cmd = parse_cpus(cmd[2]), cmd[3:]
    if cmd[1] != "-c":
        raise ValueError(f"not a one-rank CPU server's command (FORKED_ENGINE_CORE): {cmd[:3]}")
    return cpus, cmd[3:]


def run_child(request: dict, listener: socket.socket, conns: list[socket.socket]) -> None:
    """In the forked child: become the server; never returns."""
    code = 1
    try:
        listener.close()
        for c in conns:
            c.close()
        os.setsid()
        cpus, args = server_args(request["cmd"])
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the import may have fixed it: the server's TMPDIR is its own
        sys.argv = [API_SERVER, *args]
        runpy.run_module(API_SERVER, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def import_vllm() -> None:
    """The import every child is spared, and the fork of the engine core FORKED_ENGINE_CORE makes."""
    import vllm.entrypoints.openai.api_server  # noqa: F401
    import vllm.v1.engine.utils

    vllm.v1.engine.utils.get_mp_context = lambda: multiprocessing.get_context("fork")


def main() -> None:
    # Listening before the import: a client connects at once and waits for its pid, not for the socket.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(64)
    import_vllm()
    children: dict[int, socket.socket] = {}  # pid -> the connection its status goes back on
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select(timeout=0.2):
            if key.fileobj is sys.stdin:  # the session is gone: so are its launcher and servers
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return
            conn, _ = listener.accept()
            with conn.makefile("r") as f:
                request = json.loads(f.readline())
            pid = os.fork()
            if pid == 0:
                run_child(request, listener, [conn, *children.values()])
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:  # reap, and tell each client how its server ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


if __name__ == "__main__":
    main()
