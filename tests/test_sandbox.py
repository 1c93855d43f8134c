"""The sandbox's attack suite: each attack must be contained and the test process left unharmed."""

import asyncio
import os
import socket
import threading
import time

import pytest

from envs.sandbox import MAX_OUTPUT_BYTES, UID_RANGE, Sandbox, isolation_mode, run_python

ISOLATED = isolation_mode() == "root-ns"
needs_ns = pytest.mark.skipif(not ISOLATED, reason=f"isolation mode is {isolation_mode()!r}")


def run(code: str, timeout_s: float = 3.0, **kw):
    return asyncio.run(run_python(code, timeout_s=timeout_s, **kw))


def temp_dirs() -> set[str]:
    return {d for d in os.listdir("/tmp") if d.startswith("sandbox-")}


@pytest.fixture(scope="module", autouse=True)
def temp_dirs_before() -> set[str]:
    """Run dirs that exist when this module's tests start (e.g. from a trainer another test killed by
    SIGKILL, which leaves nobody to remove them) are not this module's leftovers. A fixture, not a
    module constant: collection happens before any test runs."""
    return temp_dirs()


def sandbox_processes() -> list[int]:
    """Pids of live processes owned by a sandbox uid."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and UID_RANGE[0] <= os.stat(f"/proc/{pid}").st_uid <= UID_RANGE[1]:
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_print_and_statelessness():
    r = run("print(1)\nopen('left_behind', 'w').write('x')")
    assert (r.output, r.exit_code, r.timed_out, r.truncated, r.error) == ("1\n", 0, False, False, "")
    r = run("import os; print(os.listdir('.'))")
    assert "left_behind" not in r.output, "a file from the previous call is visible"


def test_numpy_and_sympy_import():
    r = run("import numpy, sympy; print(numpy.arange(4).sum(), sympy.factorint(91))", timeout_s=10)
    assert r.exit_code == 0, r.output
    assert r.output == "6 {7: 1, 13: 1}\n"


def test_infinite_loop_is_killed():
    r = run("while True: pass", timeout_s=1)
    assert r.timed_out and "timed out after 1 s" in r.error
    assert r.duration_s < 3, f"took {r.duration_s:.1f} s to kill"


def test_sleep_past_timeout_is_killed():
    r = run("import time; print('start', flush=True); time.sleep(100)", timeout_s=1)
    assert r.timed_out and r.output == "start\n"
    assert r.duration_s < 3


def test_fork_bomb_is_contained():
    code = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    r = run(code, timeout_s=2)
    assert r.timed_out or r.exit_code != 0, "fork bomb ran to completion?"
    assert sandbox_processes() == [], "fork bomb processes survived"


def test_memory_bomb_is_contained():
    r = run("x = bytearray(8 * 1024**3)\nprint('allocated')")
    assert "MemoryError" in r.output and "allocated" not in r.output
    r = run("x = []\nwhile True: x.append(' ' * 10**7)", timeout_s=5)
    assert "MemoryError" in r.output or r.exit_code != 0


def test_huge_output_is_truncated_in_the_middle():
    r = run("import sys\nsys.stdout.write('a' * 50_000_000 + 'b' * 50_000_000)\nprint('END')", timeout_s=10)
    assert r.truncated and not r.timed_out
    assert len(r.output.encode()) < MAX_OUTPUT_BYTES + 200
    assert r.output.startswith("aaaa") and r.output.endswith("bbbbEND\n")
    assert "bytes of output omitted" in r.output


def test_binary_garbage_output_is_decoded():
    r = run("import sys; sys.stdout.buffer.write(bytes(range(256)) * 10)")
    assert r.exit_code == 0 and "\ufffd" in r.output


def test_deep_recursion():
    r = run("def f(n): return f(n + 1)\nf(0)")
    assert "RecursionError" in r.output
    # With the limit lifted, C recursion (json on a deeply nested list) overflows the C stack: the
    # child dies of SIGSEGV, not us.
    code = "import sys, json\nsys.setrecursionlimit(10**8)\nx = []\n"
    code += "for _ in range(10**6): x = [x]\njson.dumps(x)"
    r = run(code, timeout_s=5)
    assert r.exit_code == 139 and "SIGSEGV" in r.error, r


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2-secret-token")
    code = (
        "import os\nprint(dict(os.environ))\n"
        f"for p in ['/proc/1/environ', '/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ']:\n"
        "    try: print(open(p, 'rb').read())\n"
        "    except OSError as e: print(p, e)"
    )
    r = run(code)
    assert "hunter2-secret-token" not in r.output
    assert "SANDBOX_TEST_SECRET" not in r.output


@needs_ns
def test_writes_outside_the_temp_dir_fail(tmp_path):
    targets = [
        str(tmp_path / "evil"),
        "/tmp/sandbox_evil",
        "/dev/shm/sandbox_evil",
        "../sandbox_evil",
        os.path.join(os.getcwd(), "sandbox_evil"),
    ]
    code = (
        f"for p in {targets!r}:\n"
        "    try:\n        open(p, 'w').write('x'); print('WROTE', p)\n"
        "    except OSError as e:\n        print('denied', p, e.strerror)"
    )
    r = run(code)
    assert "WROTE" not in r.output, r.output
    assert not any(os.path.exists(p) for p in targets[:3] + targets[4:])
    assert not os.path.exists("/tmp/sandbox_evil")


@needs_ns
def test_network_is_unreachable():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('pypi.org', 443)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
        "    except OSError as e:\n        print('blocked', addr, e)"
    )
    r = run(code, timeout_s=10)
    assert "CONNECTED" not in r.output and r.output.count("blocked") == 3, r.output
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the parent's loopback
    listener.close()


def test_killing_the_parent_fails():
    me = os.getpid()
    code = (
        "import os, signal\n"
        f"for pid in [os.getppid(), {me}, {os.getppid()}, 1, -1]:\n"
        "    try:\n        os.kill(pid, signal.SIGKILL); print('sent', pid)\n"
        "    except OSError as e:\n        print('refused', pid, e.strerror)"
    )
    r = run(code)
    assert os.getpid() == me  # we are still here to check
    assert f"refused {me}" in r.output or ISOLATED is False, r.output


@needs_ns
def test_background_children_do_not_survive():
    code = (
        "import os, subprocess\n"
        "subprocess.Popen(['sleep', '60'])\n"
        "if os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(60)\n"
        "if os.fork() == 0:\n    os._exit(0)  # a zombie: never waited for\n"
        "print('parent done')"
    )
    r = run(code, timeout_s=5)
    assert r.output == "parent done\n" and not r.timed_out, r
    assert r.duration_s < 3, "waited for the background children"
    assert sandbox_processes() == [], "a background child survived"


def test_concurrency_cap_across_event_loops():
    """One Sandbox serves the rollout worker's loop and the trainer's eval loop at once (two threads):
    the cap holds across both, and neither loop trips over a primitive bound to the other."""
    sandbox = Sandbox(max_concurrency=2)
    code = "import time; s = time.time(); time.sleep(0.5); print(s, time.time())"

    async def many(n):
        return await asyncio.gather(*(sandbox.run(code, timeout_s=5) for _ in range(n)))

    other: list = []
    thread = threading.Thread(target=lambda: other.extend(asyncio.run(many(3))))
    thread.start()
    results = asyncio.run(many(3))
    thread.join(30)
    results += other
    assert len(results) == 6, "a loop's runs failed"
    assert all(r.exit_code == 0 for r in results), [r.error for r in results]
    spans = [tuple(map(float, r.output.split())) for r in results]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == 2, f"peak concurrency {peak}"


def test_nothing_left_behind(temp_dirs_before):
    time.sleep(0.1)
    assert sandbox_processes() == []
    left = temp_dirs() - temp_dirs_before
    assert not left, f"temp dirs left behind: {left}"


def test_run_dirs_of_a_killed_process_are_removed_by_the_next_process():
    import subprocess
    import sys
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now free: a SIGKILLed trainer's run dir looks like this one
    orphan = tempfile.mkdtemp(prefix=f"sandbox-{dead.pid}-")
    open(os.path.join(orphan, "main.py"), "w").close()
    live = tempfile.mkdtemp(prefix=f"sandbox-{os.getpid()}-")  # a live process's run in progress
    try:
        code = "import asyncio, envs.sandbox as s; print(asyncio.run(s.run_python('print(1)')).output)"
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=repo)
        assert r.stdout.strip() == "1", r.stderr
        assert not os.path.exists(orphan) and os.path.isdir(live)
    finally:
        os.rmdir(live)
