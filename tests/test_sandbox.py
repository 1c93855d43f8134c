"""The sandbox's attack suite: each attack must be contained and the test process left unharmed."""

import asyncio
import contextlib
import gc
import os
import shutil
import socket
import sys
import threading
import time

import pytest

from envs import confine
from envs.confine import MAX_PIDS, ROLLOUT_CPUS_ENV
from envs.sandbox import (
    _DISK_WATCHER,
    MAX_OUTPUT_BYTES,
    MEMORY_BUDGET_BYTES,
    UID_RANGE,
    Sandbox,
    _maps_ids,
    _whole_characters,
    isolation_mode,
    run_python,
)

ISOLATED = isolation_mode() in ("root-ns", "user-ns")
needs_ns = pytest.mark.skipif(not ISOLATED, reason=f"isolation mode is {isolation_mode()!r}")


def run(code: str, timeout_s: float = 3.0, **kw):
    return asyncio.run(run_python(code, timeout_s=timeout_s, **kw))


def temp_dirs() -> set[str]:
    return {
        d for d in os.listdir("/tmp") if d.startswith(f"sandbox-{os.getpid()}-")
    }  # ours, not other tests'


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
    assert r.duration_s < 10, f"took {r.duration_s:.1f} s to kill"  # as below: the deadline, not never


def test_sleep_past_timeout_is_killed():
    r = run("import time; print('start', flush=True); time.sleep(100)", timeout_s=1)
    assert r.timed_out and r.output == "start\n"
    assert r.duration_s < 10  # killed at its deadline, not after the sleep's 100 s


TIMED_OUT_FORKS = "import os, time\nfor _ in range(2): os.fork()\nprint('hi', flush=True)\ntime.sleep(100)"
PID_1_RUN = """
import asyncio, json, os, sys
from envs import sandbox
sandbox.isolation_mode = lambda: sys.argv[1]
r = asyncio.run(sandbox.run_python(sys.argv[2], timeout_s=1))
try:
    orphan = os.waitpid(-1, os.WNOHANG)[0] or None  # 0: only live children of ours (the disk watcher)
except ChildProcessError:
    orphan = None
print(json.dumps([os.getpid(), r.exit_code, r.timed_out, r.output, r.error, orphan]))
"""


@pytest.mark.parametrize("mode", ["root-ns", "user-ns", "seccomp", "none"])
def test_a_timed_out_run_reports_the_codes_kill_alone_and_leaves_no_orphan(mode):
    """A timed-out cold run, its code forked, with the trainer as pid 1 (a container started without
    an init: nothing else reaps an orphan). Every mode reports what the code did: its output, exit
    137, "timed out". Before: modes seccomp and none said exit 0 (their reaper's) and their shell's
    "Killed" was in the output; the namespace modes killed `unshare` first, which left the
    namespace's pid 1 to the trainer, unreaped (a zombie per timed-out run, and the run returned at
    its 5 s deadline), or to a container's init, which reaped it 1-2 s late."""
    import json
    import subprocess

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to make the trainer pid 1 of a pid namespace")
    if mode == "seccomp" and confine.seccomp_filter() is None:
        pytest.skip("no libseccomp bindings")
    argv = [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        sys.executable,
        "-c",
        PID_1_RUN,
        mode,
        TIMED_OUT_FORKS,
    ]
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    pid, exit_code, timed_out, output, error, orphan = json.loads(p.stdout.splitlines()[-1])
    assert pid == 1
    assert (exit_code, timed_out, output, error) == (137, True, "hi\n" * 4, "timed out after 1 s")
    assert orphan is None, f"the run left process {orphan} to the trainer (pid 1) to reap"


MANY_FILES_RUN = """
import asyncio, json, os, resource, sys
from envs import sandbox
sandbox.isolation_mode = lambda: sys.argv[1]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
held = [os.open(os.devnull, os.O_RDONLY)]
while held[-1] < 1100:  # the lowest free descriptors are taken: every new one is numbered above 1100
    held.append(os.open(os.devnull, os.O_RDONLY))
results = []
for warm in (False, True):
    sb = sandbox.Sandbox(1, warm=warm)
    r = asyncio.run(sb.run("print(6 * 7)", timeout_s=30))
    results.append([r.output, r.error])
    sb.close()
print(json.dumps(results))
"""


@pytest.mark.parametrize("mode", ["root-ns", "user-ns", "seccomp", "none"])
def test_runs_from_a_process_holding_over_1024_descriptors(mode):
    """A rollout process with many connections to its servers holds many descriptors. Mode seccomp set
    RLIMIT_NOFILE (128) before Landlock made its ruleset, whose descriptor then failed with EMFILE:
    every run of a process holding 128 failed to start; and the disk watcher's start (modes seccomp
    and none) used select(), which refuses a descriptor from 1024 up."""
    import json
    import resource
    import subprocess

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the open-files limit keeps descriptors under 1100")
    if mode in ("root-ns", "user-ns") and not ISOLATED:
        pytest.skip(f"isolation mode is {isolation_mode()!r}")
    if mode == "seccomp" and confine.seccomp_filter() is None:
        pytest.skip("no libseccomp bindings")
    env = {**os.environ, "PYTHONPATH": REPO}
    argv = [sys.executable, "-c", MANY_FILES_RUN, mode]
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.splitlines()[-1]) == [["42\n", ""], ["42\n", ""]]


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


@pytest.mark.parametrize("text", ["日本", "é", "😀"])
def test_truncated_output_is_cut_between_characters(text):
    """It was cut on bytes: a cut inside a multi-byte character (3-byte "日本" at the head's 8192nd
    byte; every tail but the 1-byte-aligned one) showed the model U+FFFD beside the marker."""
    r = run(f"print({text!r} * 50_000)", timeout_s=10)
    assert r.truncated and r.exit_code == 0
    assert "\ufffd" not in r.output, "a character split at the cut"
    assert len(r.output.encode()) < MAX_OUTPUT_BYTES + 200
    head, tail = r.output.split("\n\n... [")
    assert len(head.encode()) <= MAX_OUTPUT_BYTES // 2 and len(tail.split("] ...\n\n")[1].encode()) <= (
        MAX_OUTPUT_BYTES // 2
    )
    omitted = int(tail.split(" bytes of output omitted")[0])
    kept = len(head.encode()) + len(tail.split("] ...\n\n")[1].encode())
    assert omitted + kept == len(text.encode()) * 50_000 + 1, "the marker's count is the bytes not shown"


def test_the_cut_keeps_every_whole_character_at_every_split():
    """`_whole_characters` at every byte of 1- to 4-byte characters, against a plain rule: the longest
    head prefix and tail suffix that decode cleanly, and never more than 3 bytes dropped a side."""
    data = "aé日😀b€𝄞".encode() * 3
    for cut in range(len(data) + 1):
        head, tail = _whole_characters(data[:cut], data[cut:])
        best_head = max(n for n in range(cut + 1) if _decodes(data[:n]))
        best_tail = max(n for n in range(len(data) - cut + 1) if _decodes(data[len(data) - n :]))
        assert (len(head), len(tail)) == (best_head, best_tail), cut
        assert cut - len(head) <= 3 and len(data) - cut - len(tail) <= 3


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_binary_garbage_output_is_decoded():
    """Invalid bytes the code writes are its output: replaced, not dropped; at the cut as well."""
    r = run("import sys; sys.stdout.buffer.write(bytes(range(256)) * 10)")
    assert r.exit_code == 0 and "\ufffd" in r.output
    r = run("import sys; sys.stdout.buffer.write(b'\\xff' * 100_000)", timeout_s=10)
    assert r.truncated and r.output.startswith("\ufffd" * 100) and r.output.endswith("\ufffd" * 100)


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


def test_writes_outside_the_run_dir_do_not_reach_the_machine(tmp_path):
    """The run dir is the one writable place the machine sees; in the namespace modes /tmp and
    /dev/shm are the run's own empty tmpfs, so a write there lands nowhere outside."""
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
    assert r.exit_code == 0, r
    assert not any(os.path.exists(p) for p in targets[:3] + targets[4:]), r.output
    assert not [x for x in os.listdir("/tmp") if x.startswith("sandbox_evil")]


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


@needs_ns
def test_warm_path_starts_every_call_clean():
    """A variable, a file (cwd and /tmp), a monkeypatched module, a thread and a background process of
    one warm call are gone in the next; numpy is already imported when the code starts (the fork
    server's), so this is the warm path, not the cold fallback."""
    sandbox = Sandbox(max_concurrency=1)
    dirty = (
        "import builtins, os, threading, time, numpy, subprocess\n"
        "X = 1; builtins.LEAK = 1; numpy.arange = None\n"
        "open('left', 'w').write('x'); open('/tmp/left', 'w').write('x')\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"  # non-daemon: waited for
        "subprocess.Popen(['sleep', '60'])\nprint('dirty')"
    )
    check = (
        "import sys\nprint('warm' if 'numpy' in sys.modules else 'cold')\n"
        "import builtins, os, threading, numpy\n"
        "print('X' in globals(), hasattr(builtins, 'LEAK'), numpy.arange(3).sum())\n"
        "print(os.path.exists('left'), os.path.exists('/tmp/left'), threading.active_count())\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == sorted({1, os.getpid()}))"
    )

    async def two():
        return await sandbox.run(dirty, timeout_s=10), await sandbox.run(check, timeout_s=10)

    first, second = asyncio.run(two())
    assert first.output == "dirty\n" and first.exit_code == 0, first
    assert second.output == "warm\nFalse False 3\nFalse False 1\nTrue\n", second
    sandbox.close()


# Widens its own CPU affinity to every CPU: under --rollout-cpus, the CPUs the kernel then lets it run on.
WIDEN = (
    "import os\ntry: os.sched_setaffinity(0, range(os.cpu_count()))\n"
    "except OSError as e: print('refused', e)\nprint(sorted(os.sched_getaffinity(0)))"
)


def test_tool_processes_run_on_the_rollout_cpus(monkeypatch):
    """--rollout-cpus: a sandbox run (cold) and the fork server (warm) pin themselves to the rollout CPUs,
    whichever thread starts them: here the test's own thread, which may run on every CPU. Code that
    widens its own affinity to every CPU (WIDEN) stays on them where a cpuset cgroup can be made (root
    with writable cgroups)."""
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    monkeypatch.setenv(ROLLOUT_CPUS_ENV, str(cpu))
    bound = confine.cpuset_cgroup(MEMORY_BUDGET_BYTES) is not None
    code = "import os\nprint(sorted(os.sched_getaffinity(0)))\n" + WIDEN
    sandbox = Sandbox(max_concurrency=1)
    try:
        outputs = [run(code).output, asyncio.run(sandbox.run(code, timeout_s=10)).output]
    finally:
        sandbox.close()
    for out in outputs:
        assert out.splitlines()[0] == f"[{cpu}]", out
        if bound:
            assert out.splitlines()[1] == f"[{cpu}]", f"the code widened its CPUs: {out}"
    assert os.sched_getaffinity(0) == allowed


@needs_ns
def test_fork_server_dies_with_a_killed_parent():
    """SIGKILL of the process that owns a Sandbox takes its fork server and the call in flight with it
    (PR_SET_PDEATHSIG on the server's first process; the namespaces die with it)."""
    import signal
    import subprocess

    code = (
        "import asyncio, envs.sandbox as s\nsb = s.Sandbox(2)\n"
        "asyncio.run(sb.run(\"print('started', flush=True); import time; time.sleep(60)\", timeout_s=120))"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    marker = b"The sandbox's warm path"  # in the fork server's command line (python -c <its source>)

    def servers() -> list[int]:
        found = []
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and marker in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(int(pid))
            except OSError:
                pass
        return found

    before = set(servers())
    deadline = time.monotonic() + 60
    while not (set(servers()) - before) or not sandbox_processes():
        assert time.monotonic() < deadline and parent.poll() is None, "the warm call did not start"
        time.sleep(0.2)
    mine = set(servers()) - before
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while (mine & set(servers()) or sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not mine & set(servers()), "the fork server outlived its killed parent"
    assert sandbox_processes() == [], "the call outlived its killed parent"


@pytest.mark.parametrize("module", ["envs.sandbox", "envs.verify"])
def test_modules_that_fork_with_a_preexec_fn_import_the_at_fork_hooks_first(module):
    """A module that registers an at-fork hook, imported by one thread while another forks with a
    preexec_fn, makes that fork fail ("release unlocked lock": the hook's after-fork release of a lock
    its before-fork never took). asyncio imports concurrent.futures.thread lazily, on the first
    run_in_executor, which the rollout's event loop calls as the sandbox's fork server starts."""
    import subprocess

    code = f"import sys, {module}; print('concurrent.futures.thread' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", "the fork hooks are registered lazily, racing a fork"


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


def _named(name: str) -> list[int]:
    """Live processes (not zombies) named `name` (PR_SET_NAME), seen from outside every namespace."""
    return [pid for pid, comm in live_process_names().items() if comm == name]


def _sleeper(name: str) -> str:
    """Code that names itself and sleeps an hour, printing nothing (a closed output pipe cannot end it)."""
    return f"import ctypes, time\nctypes.CDLL(None).prctl(15, b'{name}', 0, 0, 0)\ntime.sleep(3600)"


def test_a_cold_call_whose_loop_closes_under_it_ends_at_its_timeout(temp_dirs_before):
    """An event loop closed while a cold call runs on it (never cancelled: a loop run until something
    else completes, then closed) no longer runs the call's timeout: the run's wall clock is also kept
    off the loop, and the code is killed and its dir removed soon after `timeout_s` all the same (it
    used to run until our process exited, an hour here)."""
    name, timeout_s = "sbx-loop-gone", 1.0
    loop = asyncio.new_event_loop()
    try:
        call = loop.create_task(run_python(_sleeper(name), timeout_s=timeout_s))

        async def until_it_runs():
            deadline = time.monotonic() + 60
            while not _named(name) and not call.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)

        loop.run_until_complete(until_it_runs())
        assert _named(name), f"the code never ran: {call.result() if call.done() else 'pending'}"
        loop.close()  # the call still pending: nothing on the loop will run again
        deadline = time.monotonic() + timeout_s + 15
        # The code killed, then its dir removed (the clock thread does both, in that order).
        while (_named(name) or temp_dirs() - temp_dirs_before) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _named(name)
        assert not left, "the code of a call whose loop closed outlived its timeout"
        assert temp_dirs() - temp_dirs_before == set(), "its run dir was left behind"
    finally:
        for pid in _named(name):
            os.kill(pid, 9)
        if not loop.is_closed():
            loop.close()
        # The pending call goes here, not in whatever the collector next interrupts (asyncio's
        # transports say "Event loop is closed" as they go; in an AST compile: a SystemError).
        call = None
        gc.collect()


PID_1_CLOSED_LOOP = """
import asyncio, json, os, sys, time
from envs import sandbox
sandbox.isolation_mode = lambda: sys.argv[1]

def processes():  # pid -> (name, state, parent pid)
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        table[int(pid)] = (stat[stat.index("(") + 1 : stat.rindex(")")], state, int(ppid))
    return table

def code_alive():
    return any(name == sys.argv[2] and state != "Z" for name, state, _ in processes().values())

loop = asyncio.new_event_loop()
call = loop.create_task(sandbox.run_python(sys.argv[3], timeout_s=1))
deadline = time.monotonic() + 60
while not code_alive() and time.monotonic() < deadline:
    loop.run_until_complete(asyncio.sleep(0.02))
first = [pid for pid, (name, _, ppid) in processes().items() if name == "unshare" and ppid == 1]
loop.close()  # the call still pending: its clock thread ends the run
deadline = time.monotonic() + 20
while code_alive() and time.monotonic() < deadline:
    time.sleep(0.05)
killed = not code_alive()
time.sleep(1)  # what its end left to us has exited by now
left = [n for pid, (n, state, ppid) in processes().items() if (ppid, state) == (1, "Z") and pid not in first]
print(json.dumps([os.getpid(), len(first), killed, left]))
"""


@needs_ns
@pytest.mark.parametrize("mode", ["root-ns", "user-ns"])
def test_a_cold_call_whose_loop_closes_under_it_leaves_no_zombie_to_a_trainer_that_is_pid_1(mode):
    """The closed-loop end (`_end_run_off_loop`) as `_end_run`: the code's processes first, `unshare`
    last. It killed `unshare` first, which left the namespace's pid 1 to the trainer; as a container's
    pid 1 the trainer reaps nothing, so each such run left a zombie for good."""
    import json
    import subprocess

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare to make the trainer pid 1 of a pid namespace")
    name = "sbx-pid1-closed"
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID_1_CLOSED_LOOP]
    argv += [mode, name, "import os\nos.fork()\n" + _sleeper(name)]  # the prologue's shell stays pid 1
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    pid, runs, killed, zombies = json.loads(p.stdout.splitlines()[-1])
    assert (pid, runs, killed) == (1, 1, True)
    assert zombies == [], f"the run left {zombies} to the trainer (pid 1), unreaped"


@needs_ns
def test_a_warm_call_cancelled_as_it_starts_is_killed():
    """A warm call cancelled as soon as it has sent its request (a rollout's sibling failing, a loop
    shutting down): its fork-server child is killed at once. Cancelled while it connected its output
    pipe, the call used to leave its status pipe open, so the child never saw it go and ran on until
    its own `timeout_s` (an hour here)."""
    name = "sbx-warm-cancel"
    sandbox = Sandbox(1)

    async def cancelled_at_once() -> None:
        assert (await sandbox.run("print(1)", timeout_s=30)).output == "1\n"  # the server is up
        call = asyncio.ensure_future(sandbox.run(_sleeper(name), timeout_s=3600))
        await asyncio.sleep(0)  # the request is sent; the call waits on its output pipe's connection
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call

    try:
        asyncio.run(cancelled_at_once())
        time.sleep(3)  # time for the child to start and name itself, were it left to run
        assert not _named(name), "a warm call cancelled as it started left its child running"
    finally:
        for pid in _named(name):
            os.kill(pid, 9)
        sandbox.close()


@needs_ns
@pytest.mark.skipif(_maps_ids(isolation_mode()), reason="the code cannot run before its uid maps are written")
def test_a_cold_call_whose_start_is_cancelled_is_killed(monkeypatch, temp_dirs_before):
    """asyncio.run ending as a cold call starts its process cancels the start itself (the task under
    the shield, not only the call): asyncio then kills the run's first process alone (`unshare`).
    Landed between unshare's fork and its child's parent-death signal (`--kill-child`, ~1 in 24 such
    ends seen), that left the namespace's pid 1 running the code past its timeout and our process.
    Faked here: no --kill-child, the start held until the code runs, then cancelled once its pipes
    are connected (where asyncio.run's end cancels it)."""
    import subprocess

    import envs.sandbox as sandbox_module

    # Not "sbx-...": the attack suite, run by another process on this machine, kills those by name.
    name, popen, command, cancelled = "sbx_start_kill", subprocess.Popen, sandbox_module._command, []
    connection_made = asyncio.subprocess.SubprocessStreamProtocol.connection_made

    class HeldPopen(popen):
        def __init__(self, *args, **kwargs):
            subprocess.Popen = popen  # this call's start alone
            super().__init__(*args, **kwargs)
            deadline = time.monotonic() + 60  # until the code runs, or the run ended without it
            while not _named(name) and self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)

    def connected_then_cancelled(protocol, transport) -> None:
        connection_made(protocol, transport)
        # The start's last step: its result is set next, and every task is cancelled first, the one
        # that awaits it included, as asyncio.run's end does.
        for task in asyncio.all_tasks():
            cancelled.append((task.get_coro().__qualname__, task.cancel()))

    def unkillable_child(*args, **kwargs) -> list[str]:
        return [arg for arg in command(*args, **kwargs) if arg != "--kill-child"]

    async def cancelled_as_it_starts() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await run_python(_sleeper(name), timeout_s=1)

    monkeypatch.setattr(sandbox_module, "_command", unkillable_child)
    monkeypatch.setattr(subprocess, "Popen", HeldPopen)  # asyncio's transports start through it
    monkeypatch.setattr(
        asyncio.subprocess.SubprocessStreamProtocol, "connection_made", connected_then_cancelled
    )
    try:
        asyncio.run(cancelled_as_it_starts())
        assert ("_spawn", True) in cancelled, f"the start was not cancelled: {cancelled}"
        time.sleep(2)  # past its timeout
        assert not _named(name), "a cold call whose start was cancelled left its code running"
        assert temp_dirs() - temp_dirs_before == set(), "its run dir was left behind"
    finally:
        for pid in _named(name):
            os.kill(pid, 9)


def test_nothing_left_behind(temp_dirs_before):
    gc.collect()  # a Sandbox dropped stops its fork server, whose thread then removes its dir
    time.sleep(1)
    assert sandbox_processes() == []
    left = temp_dirs() - temp_dirs_before
    assert not left, f"temp dirs left behind: {left}"


@pytest.mark.parametrize("how", ["close", "exit", "os._exit"])
def test_no_run_dir_left_by_a_process_that_closes_its_sandbox_or_exits(how):
    """A process that used both paths leaves no run dir of its pid: none once it has closed its
    Sandbox, none once it has exited normally (its fork server's dir included), none once it has left
    by os._exit as the rollout process does (no atexit: the fork server's dir went once it was up)."""
    import subprocess

    code = (
        "import asyncio, os, sys, envs.sandbox as s\nsb = s.Sandbox(2)\n"
        "print(asyncio.run(sb.run('print(1)', timeout_s=30)).output, end='')\n"
        "print(asyncio.run(s.run_python('print(1)', timeout_s=30)).output, end='')\n"
        "if sys.argv[1] == 'close':\n    sb.close()\n"
        "    print([d for d in os.listdir('/tmp') if d.startswith(f'sandbox-{os.getpid()}-')])\n"
        "print(os.getpid(), flush=True)\n"
        "if sys.argv[1] == 'os._exit':\n    os._exit(0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, how], capture_output=True, text=True, timeout=120, cwd=REPO, check=False
    )
    *lines, pid = r.stdout.split()
    assert lines == ["1", "1"] + ["[]"] * (how == "close"), r.stdout + r.stderr
    left = [d for d in os.listdir("/tmp") if d.startswith(f"sandbox-{pid}-")]
    assert not left, f"run dirs left by a process that exited normally: {left}"


@pytest.mark.parametrize("next_path", ["warm", "cold"])
def test_run_dirs_of_a_killed_process_are_removed_by_the_next_process(next_path):
    import subprocess
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now free: a SIGKILLed trainer's run dir looks like this one
    namespace = confine.pid_namespace()
    orphan = tempfile.mkdtemp(prefix=f"sandbox-{dead.pid}-{namespace}-")
    open(os.path.join(orphan, "main.py"), "w").close()
    live = tempfile.mkdtemp(prefix=f"sandbox-{confine.owner_tag()}-")  # a live process's run in progress
    # A run in progress of a process in another pid namespace, whose pid is free in ours.
    elsewhere = tempfile.mkdtemp(prefix=f"sandbox-{dead.pid}-{namespace + 1}-")
    try:
        # The next process uses one path only: a trainer's runs all go warm in the namespace modes.
        code = (
            "import asyncio, envs.sandbox as s\n"
            f"sb = s.Sandbox(1, warm={next_path == 'warm'})\n"
            "print(asyncio.run(sb.run('print(1)', timeout_s=30)).output)"
        )
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
        )
        assert r.stdout.strip() == "1", r.stderr
        assert not os.path.exists(orphan) and os.path.isdir(live) and os.path.isdir(elsewhere)
    finally:
        os.rmdir(live)
        os.rmdir(elsewhere)


def _python_with_venv_at(where: str, tmp_root: str) -> list[str]:
    """argv prefix running this venv's python as if the venv lay at `where`: 'elsewhere' (where it is),
    'tmp-dir' (bound onto a directory under /tmp, in a private mount namespace) or 'tmp-link' (a
    symlink under /tmp, as a checkout's `.venv` link in a CI clone)."""
    if where == "elsewhere" and not sys.prefix.startswith("/tmp/"):
        return [sys.executable]
    venv = os.path.join(tmp_root, "venv")  # 'elsewhere' from a venv under /tmp: tmp_root is /var/tmp's
    if where == "tmp-link":
        os.symlink(sys.prefix, venv)
        return [os.path.join(venv, "bin", "python")]
    os.mkdir(venv)
    shell = f'mount --bind "{sys.prefix}" "{venv}" && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", shell, "sh"] + [
        os.path.join(venv, "bin", "python")
    ]


@pytest.mark.parametrize("where", ["elsewhere", "tmp-dir", "tmp-link"])
def test_warm_path_imports_what_the_cold_path_imports(where):
    """A module the fork server did not import (numpy.polynomial, pandas) imports on both paths
    whether the venv lies under /tmp (a CI clone made with mktemp -d) or elsewhere."""
    import json
    import subprocess
    import tempfile

    elsewhere_by_bind = where == "elsewhere" and sys.prefix.startswith("/tmp/")  # a CI clone's venv
    if (where == "tmp-dir" or elsewhere_by_bind) and os.geteuid() != 0:
        pytest.skip("needs root to bind the venv to another directory")
    code = (
        "import sys\nloaded = [m for m in ('numpy.polynomial', 'pandas') if m in sys.modules]\n"
        "import numpy.polynomial, pandas\nprint(loaded, numpy.polynomial.Polynomial([1, 2])(3), sys.prefix)"
    )
    script = (
        "import asyncio, json, sys, envs.sandbox as s\n"
        f"code = {code!r}\nwarm, cold = s.Sandbox(1), s.Sandbox(1, warm=False)\n"
        "async def both():\n    return [await sb.run(code, timeout_s=60) for sb in (warm, cold)]\n"
        "out = asyncio.run(both())\n"  # one event loop: no executor shut down and made again between
        "print(json.dumps([sys.prefix, s.isolation_mode()] + [r.output + r.error for r in out]))"
    )
    with tempfile.TemporaryDirectory(
        prefix="venv-", dir="/var/tmp" if where == "elsewhere" else "/tmp"
    ) as tmp_root:
        argv = _python_with_venv_at(where, tmp_root) + ["-c", script]
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": REPO}
        p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    prefix, mode, warm, cold = json.loads(p.stdout.splitlines()[-1])
    assert prefix.startswith("/tmp/") == (where != "elsewhere"), prefix
    assert cold == f"[] 7.0 {prefix}\n", cold
    assert warm == cold, f"warm path ({mode}): {warm}"


# THE ATTACK SUITE IN EVERY ISOLATION MODE
# Each mode's privilege conditions are re-created for real in a child that runs this file as a script
# (`attacks` below), from this checkout and from a copy under /tmp (a CI clone), and reports what each
# attack printed through both paths (warm: the fork server; cold: `run_python`), then what a fork bomb
# did to each path.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "hunter2-secret-token"
TEST_USER = "sandbox-test"
# The checkout's own sources, by a path suffix no installed library shares.
CHECKOUT_SOURCES = ("/train_async_grpo.py", "/envs/sandbox.py", "/envs/retool.py", "/envs/confine.py")
BOMB = "import os\nwhile True: os.fork()"
SHM_KEY = 0x5EEDBEEF  # the ipc attack's segment
# A bomb fills its limit (hundreds of processes) in well under a second; longer runs of it only spin
# (2 x 20 of them in the attack tests: 3 s each cost ~80 s of the suite).
BOMB_TIMEOUT_S = 1.0
# The bomb's run ends this long after its timeout at most: killing up to MAX_PIDS processes took 2.0 s
# over it on a 2-core machine at load ~100; the bound is there to catch a run that waits on its bomb.
BOMB_KILL_S = 10.0
# How many processes the code can have at once: children that sleep (output closed: the call ends when
# the parent does) until fork fails, or FORK_CAP, so a sandbox with no limit fails the test without
# flooding the machine.
FORK_CAP = 600
COUNT_FORKS = (
    "import os, time\nn = 0\nwhile n < FORK_CAP:\n    try: pid = os.fork()\n    except OSError: break\n"
    "    if pid == 0: os.close(1); os.close(2); time.sleep(60); os._exit(0)\n    n += 1\nprint(n)"
).replace("FORK_CAP", str(FORK_CAP))
# How many threads the code can have at once: daemon threads that sleep, started until that fails, or
# FORK_CAP; each count printed as it is reached (where nothing bounds threads, seccomp refuses them).
COUNT_THREADS = (
    "import threading, time\nthreading.stack_size(65536)\nn = 0\nwhile n < FORK_CAP:\n"
    "    try: threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "    except RuntimeError: break\n    n += 1\n    print(n, flush=True)"
).replace("FORK_CAP", str(FORK_CAP))
ATTACKS = {
    "walk": (
        "import os\nfor top, dirs, files in os.walk('/'):\n"
        "    if top == '/': dirs[:] = [d for d in dirs if d not in ('proc', 'sys', 'dev')]\n"
        "    for f in files:\n        p = os.path.join(top, f)\n"
        f"        if p.endswith(('.jsonl', '.safetensors') + {CHECKOUT_SOURCES!r}): print('FOUND', p)\n"
        "print('walked')"
    ),
    "environ": (
        "import os\nprint(dict(os.environ))\n"
        "try: pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "except OSError: pids = range(1, 1 << 15)\n"
        "for pid in pids:\n"
        "    try: print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n    except OSError: pass\n"
        "print('read')"
    ),
    "connect": (
        "import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', int(PORT)), timeout=2)\n"
        "    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', e)"
    ),
    # SIGKILL to the test's own processes (TARGETS: this process, its parent, its sleeper), and
    # signal 0 to every other visible pid: the same permission checks, but a sandbox that regresses
    # fails this test instead of killing every process of the machine.
    "kill": (
        "import os, signal\n"
        "for pid in TARGETS:\n"
        "    try: os.kill(pid, signal.SIGKILL); print('KILLED', pid)\n    except OSError: pass\n"
        "try: pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]\n"
        "except OSError: pids = range(1, 1 << 15)\n"
        "for pid in [*pids, -1]:\n"
        "    if pid != os.getpid():\n"
        "        try: os.kill(pid, 0); print('SIGNALLABLE', pid)\n        except OSError: pass\n"
        "print('done')"
    ),
    # Every path bound into the minimal root (BINDS: the sandbox's own list) must be a read-only
    # mount there: the code's uid alone (no write permission) would hide a read-write bind. Without a
    # minimal root (mode seccomp) these are the machine's own mounts, and only the write must fail.
    "readonly": (
        "import os\nfor p in BINDS:\n"
        "    if not os.statvfs(p).f_flag & os.ST_RDONLY: print('WRITABLE-MOUNT', p)\n"
        "    d = p if os.path.isdir(p) else os.path.dirname(p)\n"
        "    try: open(os.path.join(d, 'sandbox_rw_probe'), 'w').close(); print('WROTE', d)\n"
        "    except OSError: pass\n"
        "print('checked', len(BINDS))"
    ),
    # A signal to a process of ours by way of a file's owner (OWNERS: this process and its
    # process group, which holds the sleeper): F_SETOWN/F_SETOWN_EX + F_SETSIG + O_ASYNC on a pipe, and
    # FIOSETOWN/SIOCSPGRP + O_ASYNC on a socketpair, then data that makes each readable. The kernel
    # checks the uid that set the owner, not capabilities: root, or our uid, reaches us. We count what
    # arrives (`_count_signal`); the sleeper dies of it.
    "signal": (
        "import ctypes, fcntl, os, signal, socket, struct, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def attempt(name, call):\n"
        "    try: call(); print('OWNER SET', name)\n"
        "    except OSError as e: print('refused', name, e.strerror)\n"
        "for target in OWNERS:\n"
        "    r, w = os.pipe()\n    a, b = socket.socketpair()\n"
        "    owner_ex = struct.pack('ii', 2 if target < 0 else 1, abs(target))  # F_OWNER_PGRP / _PID\n"
        "    attempt('F_SETOWN', lambda: fcntl.fcntl(r, fcntl.F_SETOWN, target))\n"
        "    attempt('F_SETOWN_EX', lambda: fcntl.fcntl(r, 15, owner_ex))\n"
        "    attempt('F_SETSIG', lambda: fcntl.fcntl(r, 10, signal.SIGUSR1))\n"
        "    attempt('FIOSETOWN', lambda: fcntl.ioctl(a, 0x8901, struct.pack('i', target)))\n"
        "    attempt('SIOCSPGRP', lambda: fcntl.ioctl(b, 0x8902, struct.pack('i', target)))\n"
        "    if os.uname().machine == 'x86_64':  # the kernel reads cmd as 32 bits: F_SETOWN all the same\n"
        "        def high_bits():\n"
        "            if libc.syscall(72, r, (1 << 32) | 8, target) < 0:  # SYS_fcntl\n"
        "                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n"
        "        attempt('F_SETOWN|1<<32', high_bits)\n"
        "    for fd in (r, a.fileno(), b.fileno()):\n"
        "        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)\n"
        "    os.write(w, b'x'); a.send(b'x'); b.send(b'x')\n"
        "time.sleep(0.2)\nprint('signalled')"
    ),
    # Processes that leave the run: a double-fork daemon in a session of its own (one keeps the output
    # pipe open) and a setsid() child, named so they can be found from outside any namespace.
    "daemon": (
        "import ctypes, os, time\n"
        "ready_r, ready_w = os.pipe()\n"
        "def detach(name, double, keep_output):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if not double or os.fork() == 0:\n"
        "            if not keep_output: os.close(1); os.close(2)\n"
        "            ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME\n"
        "            os.write(ready_w, b'x')\n"
        "            time.sleep(3600)  # found and killed by the suite if it outlives its run\n"
        "        os._exit(0)\n"
        "try:\n"
        "    detach(b'sbx-daemon-out', True, True); detach(b'sbx-daemon', True, False)\n"
        "    detach(b'sbx-setsid', False, False)\n"
        "    for _ in range(3): os.read(ready_r, 1)  # all three detached and named: now we leave\n"
        "except OSError as e: print('no fork', e)\n"
        "print('detached')"
    ),
    # The disk: RLIMIT_FSIZE bounds each file (16 MiB), not how many; 96 of them are 1.5 GiB. Written
    # to the run dir, and written then unlinked while kept open (gone from the dir, not from the disk).
    "disk": (
        "chunk, n = b'x' * (1 << 20), 0\ntry:\n    for i in range(96):\n"
        "        with open(f'disk{i}', 'wb') as f:\n            for _ in range(16): f.write(chunk)\n"
        "        n += 16; print('MiB', n, flush=True)\n"
        "except OSError as e: print('stopped', e.strerror)\nprint('disk done')"
    ),
    "disk-unlinked": (
        "import os, time\nchunk, n, kept = b'x' * (1 << 20), 0, []\ntry:\n    for i in range(96):\n"
        "        f = open(f'disk{i}', 'wb'); kept.append(f); os.unlink(f'disk{i}')\n"
        "        for _ in range(16): f.write(chunk)\n"
        "        f.flush(); n += 16; print('MiB', n, flush=True)\n"
        "except OSError as e: print('stopped', e.strerror)\ntime.sleep(1)\nprint('disk done')"
    ),
    # Another process's limits, CPUs and priority (TARGETS), each set to what it already is (harmless
    # if the sandbox regresses): where the code's uid is ours, RLIMIT_CPU of 1 s killed the trainer.
    "limits": (
        "import os, resource\nCORE, WHO = resource.RLIMIT_CORE, os.PRIO_PROCESS\n"
        "for pid in TARGETS:\n"
        "    try: resource.prlimit(pid, CORE, resource.prlimit(pid, CORE)); print('LIMITED', pid)\n"
        "    except OSError: pass\n"
        "    try: os.sched_setaffinity(pid, os.sched_getaffinity(pid)); print('PINNED', pid)\n"
        "    except OSError: pass\n"
        "    try: os.setpriority(WHO, pid, os.getpriority(WHO, pid)); print('RENICED', pid)\n"
        "    except OSError: pass\n"
        "print('limits tried')"
    ),
    # A System V segment by a fixed key: it outlives its run (memory charged to the sandbox's cgroup, or
    # the machine's) unless the run's IPC namespace dies with it; the next run (the cold path runs after
    # the warm one) finds it.
    "ipc": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"shmid = libc.shmget({SHM_KEY}, 1 << 20, 0o1000 | 0o2000 | 0o600)  # IPC_CREAT | IPC_EXCL\n"
        "if shmid >= 0: print('SHM CREATED')\n"
        "elif ctypes.get_errno() == 17: print('SHM EXISTS')  # EEXIST: an earlier run's\n"
        "else: print('refused', ctypes.get_errno())"
    ),
    # SIGKILL to the code's own process group: on the warm path it held the fork-server child that keeps
    # the call's deadline (the code, its pid namespace's init, ignores the signal), and the code ran on
    # past its call.
    "group-kill": "import os, signal, time\nos.kill(0, signal.SIGKILL)\ntime.sleep(1)\nprint('survived')",
    # A file in a dir the code then makes unreadable: where the code's uid is ours (a plain user, mode
    # seccomp) our removal of its run dir skipped it, and its files stayed on the disk for good.
    "locked-dir": (
        "import os\nos.mkdir('locked')\nopen('locked/f', 'wb').write(b'x' * (1 << 20))\n"
        "os.chmod('locked', 0)\nprint('locked')"
    ),
    # Not an attack: what the disk cap must leave alone (a few files and a dir, 20 MiB in all).
    "small-writes": (
        "import os\nos.mkdir('d')\nfor i in range(20): open(f'd/{i}', 'wb').write(os.urandom(1 << 20))\n"
        "print('small', sum(os.path.getsize(f'd/{i}') for i in range(20)) >> 20)"
    ),
}
# How far past the disk cap (64 MiB) a run may get where no tmpfs bounds it (modes seccomp, none): what
# it writes, at up to ~3 GiB/s, until the watcher's next look and the kill: 64-128 MiB, kept files and
# unlinked alike, with our threads busy or not. The watcher a thread of ours, our threads' hold on the
# GIL made a look take up to a second: 1,424 MiB once under `make test`'s load. How soon a look comes
# is test_disk_watcher_looks_for_deleted_files_...'s.
DISK_WRITTEN_MAX_MIB = 1024


def mib_written(output: str) -> int:
    """What a disk attack says it wrote before it was stopped ("MiB N" lines)."""
    return max((int(line.split()[1]) for line in output.splitlines() if line.startswith("MiB ")), default=0)


# A call cancelled while its code and a child of it run (a rollout's sibling tool call failing, the
# rollout stopping): the child must not outlive the call.
CANCELLED = (
    "import ctypes, os, time\n"
    "try: pid = os.fork()\n"
    "except OSError as e: print('no fork', e); raise SystemExit\n"  # where the code may not fork at all
    "if pid == 0:\n"
    "    ctypes.CDLL(None).prctl(15, b'sbx-cancelled', 0, 0, 0)  # PR_SET_NAME\n"
    "time.sleep(3600)"
)
SIGNALS_CAUGHT: list[int] = []


def _count_signal(signum: int, frame) -> None:
    SIGNALS_CAUGHT.append(signum)


def live_process_names() -> dict[int, str]:
    """pid: name (PR_SET_NAME) of every live process (zombies are dead already), from outside every
    namespace."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                found[int(pid)] = name
        except OSError:  # gone
            pass
    return found


def detached_processes() -> list[str]:
    """'pid name' of every live process the daemon attack named (from outside every namespace)."""
    return [f"{pid} {name}" for pid, name in live_process_names().items() if name.startswith("sbx-")]


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, cwd or '') of every live process."""
    table = {}
    for pid in os.listdir("/proc"):
        try:
            if not pid.isdigit():
                continue
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                cwd = ""
            table[int(pid)] = (int(fields[1]), fields[0], cwd)
        except (OSError, IndexError):
            pass
    return table


def run_processes(exclude: set[int] = frozenset()) -> set[int]:
    """Live (not zombie) processes of this process's sandbox runs: its descendants (an orphan in a pid
    namespace stays inside it) and any process whose cwd is one of its run dirs (a cold run without a
    pid namespace, whose orphans go to init); those in `exclude` left out."""
    table = _proc_table()
    marker = f"/sandbox-{os.getpid()}-"

    def descends(pid: int) -> bool:
        for _ in range(64):
            pid = table[pid][0] if pid in table else 0
            if pid in (0, 1) or pid == os.getpid():
                return pid == os.getpid()
        return False

    return {
        pid
        for pid, (_, state, cwd) in table.items()
        if state != "Z" and pid not in exclude and (descends(pid) or marker in cwd)
    }


def descendants(pid: int) -> set[int]:
    table = _proc_table()
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += [c for c, (ppid, _, _) in table.items() if ppid == p and c not in found]
    return found


def bomb_then_print(sandbox: Sandbox, others: list[Sandbox]) -> dict:
    """A fork bomb, then an innocent call, through `sandbox`: how long the bomb took, what the next
    call printed, how many processes a third call could start and threads a fourth, and which
    processes of the four are left once they have returned (the fork servers of `others` and of
    `sandbox`, and the disk watcher of the modes without a tmpfs, are not)."""

    async def in_turn():
        bomb = await sandbox.run(BOMB, timeout_s=BOMB_TIMEOUT_S)
        after = await sandbox.run("print(2)", timeout_s=30)
        forks = await sandbox.run(COUNT_FORKS, timeout_s=30)
        return bomb, after, forks, await sandbox.run(COUNT_THREADS, timeout_s=30)

    bomb, after, forks, threads = asyncio.run(in_turn())
    servers = [s._server.proc.pid for s in [sandbox, *others] if s._server and s._server.proc]
    servers += [_DISK_WATCHER._proc.pid] if _DISK_WATCHER._proc else []
    deadline = time.monotonic() + 1  # the kernel reaps the killed tree; give it a moment
    while (left := run_processes(set().union(*map(descendants, servers)))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "duration_s": bomb.duration_s,
        "bomb_error": bomb.error,
        "next": after.output + after.error,
        "left": sorted(left),
        "processes": forks.output + forks.error,
        "threads": (threads.output.split() or ["0"])[-1] + " " + threads.error,
    }


def widened_cpus() -> dict:
    """Under --rollout-cpus (one CPU: our last), what WIDEN ends up on, warm and cold, and whether a
    cpuset cgroup could be made to hold it there."""
    cpu = max(os.sched_getaffinity(0))
    os.environ[ROLLOUT_CPUS_ENV] = str(cpu)
    try:
        sandbox = Sandbox(max_concurrency=1)  # its fork server starts under the rollout CPUs
        try:
            warm = asyncio.run(sandbox.run(WIDEN, timeout_s=30))
        finally:
            sandbox.close()
        cold = asyncio.run(run_python(WIDEN, timeout_s=30))
        held = confine.cpuset_cgroup(MEMORY_BUDGET_BYTES) is not None
        return {
            "cpu": cpu,
            "cpuset": held,
            "warm": warm.output + warm.error,
            "cold": cold.output + cold.error,
        }
    finally:
        del os.environ[ROLLOUT_CPUS_ENV]


def attack_suite(port: int) -> dict:
    """Run every attack through a warm and a cold Sandbox, with a sleeper of ours that must outlive
    them; then a fork bomb and an innocent call through each."""
    import signal
    import subprocess

    from envs.confine import landlock_description, pids_cgroup, visible_paths
    from envs.sandbox import MEMORY_BUDGET_BYTES, isolation_gaps

    for signum in (signal.SIGUSR1, signal.SIGIO, signal.SIGURG):
        signal.signal(signum, _count_signal)
    sleeper = subprocess.Popen(["sleep", "300"])  # in our process group: OWNERS reach it
    paths = {"warm": Sandbox(max_concurrency=2), "cold": Sandbox(max_concurrency=2, warm=False)}
    # our parent too, unless it is init (a run under nohup): in a pid namespace 1 is the sandbox's own
    targets = [os.getpid(), sleeper.pid] + [os.getppid()] * (os.getppid() != 1)
    codes = [
        code.replace("PORT", str(port))
        .replace("TARGETS", str(targets))
        .replace("BINDS", repr(visible_paths()[0]))
        .replace("OWNERS", str([os.getpid(), -os.getpgrp()]))
        for code in ATTACKS.values()
    ]

    async def all_attacks(sandbox):
        return await asyncio.gather(*(sandbox.run(c, timeout_s=120) for c in codes))

    async def cancelled(sandbox, starting: bool = False) -> list[str]:
        """Cancel a call once its child runs: the child if it outlived the call (killed then); nothing
        where the code may not fork; else what the call said without its child running. `starting`:
        the call is cancelled while still starting its process, as on a loaded machine, where the
        event loop's thread can lose the CPU between the fork and the end of the start long enough for
        the code to run (faked: held inside Popen until the child runs)."""

        popen = subprocess.Popen

        class HeldPopen(popen):
            def __init__(self, *args, **kwargs):
                subprocess.Popen = popen  # this call's start alone
                super().__init__(*args, **kwargs)
                deadline = time.monotonic() + 60  # until the child runs, or the run ended without one
                while not any("sbx-cancelled" in p for p in detached_processes()) and self.poll() is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)

        subprocess.Popen = HeldPopen if starting else popen  # asyncio's transports start through it
        call = asyncio.ensure_future(sandbox.run(CANCELLED, timeout_s=120))
        deadline = time.monotonic() + 60
        while not (seen := any("sbx-cancelled" in p for p in detached_processes())) and not call.done():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        if call.done() and not seen:
            output = call.result().output + call.result().error
            return [] if output.startswith("no fork") else [f"ended without its child: {output[-300:]}"]
        call.cancel()
        subprocess.Popen = popen
        # An orphan holding the output pipe would keep the cancelled call waiting on it for ever.
        done, _ = await asyncio.wait({call}, timeout=30)
        await asyncio.sleep(0.5)  # what the kernel still has to reap
        left = [p for p in detached_processes() if p.endswith(" sbx-cancelled")]
        for line in left:
            os.kill(int(line.split()[0]), 9)
        with contextlib.suppress(asyncio.CancelledError):
            await call
        hung = [] if done else ["the call went on 30 s after its cancel"]
        return hung + left if seen else ["its child never ran in 60 s"]

    outputs, cancels_left = {}, {}
    try:
        for path, sandbox in paths.items():
            for name, r in zip(ATTACKS, asyncio.run(all_attacks(sandbox)), strict=True):
                outputs[f"{path}/{name}"] = r.output + r.error
            cancels_left[path] = asyncio.run(cancelled(sandbox))
        # Where we write its uid maps once started (user-ns), the code cannot run before that.
        starting = not _maps_ids(isolation_mode())
        cancels_left["starting"] = asyncio.run(cancelled(paths["cold"], starting=True)) if starting else []
        time.sleep(0.5)  # a signal on its way; a daemon naming itself
        alive, detached = sleeper.poll() is None, detached_processes()
    finally:  # a failed test leaves nothing behind either (the sleeper holds the test's output pipe)
        for line in detached_processes():
            os.kill(int(line.split()[0]), 9)
        subprocess.run(["ipcrm", "-M", hex(SHM_KEY)], capture_output=True, check=False)
        sleeper.kill()
        sleeper.wait()
    run_dirs_left = sorted(temp_dirs())  # every run has ended
    bombs = {path: bomb_then_print(sandbox, list(paths.values())) for path, sandbox in paths.items()}
    cpus = widened_cpus()
    return {
        "mode": isolation_mode(),
        "gaps": isolation_gaps(),
        "install": sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}),
        "sleeper_alive": alive,
        "signals": SIGNALS_CAUGHT,
        "detached": detached,
        "cancels_left": cancels_left,
        "landlock": landlock_description(),
        "startup": startup_line(),
        "outputs": outputs,
        "bombs": bombs,
        "pids_cgroup": pids_cgroup(MEMORY_BUDGET_BYTES),
        "run_dirs_left": run_dirs_left,
        "cpus": cpus,
    }


def startup_line() -> str:
    """What the trainer says of the sandbox as it starts (`envs.episode_maker`)."""
    import io

    import envs

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        envs.episode_maker("retool", 1, unsafe_sandbox=True)
    return printed.getvalue()


def check_attacks(report: dict, listener: socket.socket) -> None:
    assert report["sleeper_alive"], "the sandbox killed a process of ours"
    assert report["signals"] == [], f"signals reached us: {report['signals']}"
    assert report["detached"] == [], f"processes outlived their run: {report['detached']}"
    assert report["run_dirs_left"] == [], "run dirs outlived their run"
    assert report["cancels_left"] == {"warm": [], "cold": [], "starting": []}, (
        f"outlived a cancelled call: {report['cancels_left']}"
    )
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached our loopback
    for path in ("warm", "cold"):
        out = {name: report["outputs"][f"{path}/{name}"] for name in ATTACKS}
        found = [line.split(" ", 1)[1] for line in out["walk"].splitlines() if line.startswith("FOUND ")]
        # The Python install may carry data files of its own (a library's .safetensors); nothing else may.
        leaked = [p for p in found if not any(p.startswith(d + "/") for d in report["install"])]
        assert not leaked, f"{path}: the code found {leaked}"
        assert "walked" in out["walk"], out["walk"]
        assert SECRET not in out["environ"] and "read" in out["environ"], out["environ"][-2000:]
        assert "CONNECTED" not in out["connect"] and "blocked" in out["connect"], out["connect"]
        assert "done" in out["kill"] and "KILLED" not in out["kill"], out["kill"]
        assert "checked" in out["readonly"] and "WROTE" not in out["readonly"], out["readonly"]
        assert "signalled" in out["signal"], out["signal"]
        assert "detached" in out["daemon"] or "no fork" in out["daemon"], out["daemon"]
        assert out["small-writes"] == "small 20\n", out["small-writes"]
        assert "limits tried" in out["limits"], out["limits"]
        assert not any(w in out["limits"] for w in ("LIMITED", "PINNED", "RENICED")), out["limits"]
        assert "SHM EXISTS" not in out["ipc"], out["ipc"]
        if path == "warm":  # the call kept its deadline (cold: the kill may end the code's own run)
            assert "failed the call" not in out["group-kill"], out["group-kill"]
        for disk in ("disk", "disk-unlinked"):
            if report["mode"] in ("root-ns", "user-ns"):  # the tmpfs at /sandbox is full
                assert "stopped No space left on device" in out[disk], out[disk]
                assert mib_written(out[disk]) <= 64, out[disk]
            else:  # the watcher killed it
                assert "killed (the sandbox's disk cap)" in out[disk], out[disk]
                assert mib_written(out[disk]) <= DISK_WRITTEN_MAX_MIB, out[disk]
        if report["mode"] in ("root-ns", "user-ns"):
            assert "WRITABLE-MOUNT" not in out["readonly"], out["readonly"]
        else:  # in the namespace modes the pids seen are the run's own namespace
            assert "SIGNALLABLE" not in out["kill"], out["kill"]
            assert "OWNER SET" not in out["signal"], out["signal"]  # seccomp refuses every way, at every ABI
    cpus = report["cpus"]
    for path in (
        "warm",
        "cold",
    ):  # where no cpuset can be made (a plain user, read-only cgroups) it may leave
        assert cpus[path].endswith("]\n"), cpus
        if cpus["cpuset"]:
            assert cpus[path].endswith(f"[{cpus['cpu']}]\n"), f"the code left the rollout CPUs: {cpus}"
    for path, bomb in report["bombs"].items():
        assert bomb["duration_s"] <= BOMB_TIMEOUT_S + BOMB_KILL_S, (path, bomb)
        assert bomb["next"] == "2\n", (path, bomb)
        assert bomb["left"] == [], (path, bomb)
        # The most any limit allows: the pids cgroup (RLIMIT_NPROC is lower where it binds).
        assert int(bomb["processes"].split()[0]) <= MAX_PIDS, (path, bomb)
        # Threads too: where uid 0 may not fork, seccomp refuses threads as well (600, the cap, before;
        # a watcher killing the run past 256 let 600 start under CI's load).
        assert int(bomb["threads"].split()[0]) <= MAX_PIDS, (path, bomb)


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    s.setblocking(False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory):
    """This checkout, and a copy of what the attack child needs (and the walk looks for) in a temp dir
    under /tmp, as a CI clone would be."""
    import tempfile

    copy = tempfile.mkdtemp(prefix="checkout-")
    os.chmod(copy, 0o755)  # readable by the code's uid: only the sandbox may hide it
    for rel in ["tests/test_sandbox.py", *(s.lstrip("/") for s in CHECKOUT_SOURCES)]:
        os.makedirs(os.path.dirname(os.path.join(copy, rel)), exist_ok=True)
        shutil.copy(os.path.join(REPO, rel), os.path.join(copy, rel))
    for name in os.listdir(os.path.join(REPO, "envs")):
        if name.endswith(".py"):
            shutil.copy(os.path.join(REPO, "envs", name), os.path.join(copy, "envs", name))
    yield {"work": REPO, "tmp": copy}
    shutil.rmtree(copy)


def expose_python_shell(repo: str) -> str:
    """Shell (run as root in a private mount namespace) making the Python install and the checkout's
    test and envs code reachable by other uids: here the install lies below /root (mode 700), where a
    container would have it in /usr/local, and a checkout may lie in a private temp dir (a CI clone)."""
    from envs.confine import blocked_ancestors

    blocked: dict[str, set[str]] = {}
    for p in (sys.executable, sys.prefix, sys.base_prefix, f"{repo}/tests", f"{repo}/envs"):
        for parent, children in blocked_ancestors(p).items():
            blocked.setdefault(parent, set()).update(children)
    lines = ["set -e"]
    for parent in sorted(blocked, key=len):  # an outer directory first: the inner ones move with it
        children = sorted(blocked[parent])
        for i, child in enumerate(children):
            lines.append(f'S{i}=$(mktemp -d); mount --rbind "{parent}/{child}" "$S{i}"')
        lines.append(f'mount -t tmpfs -o mode=755 tmpfs "{parent}"')
        for i, child in enumerate(children):
            lines.append(f'mkdir "{parent}/{child}"; mount --move "$S{i}" "{parent}/{child}"')
    return "\n".join(lines)


AS_TEST_USER = [f"--reuid={TEST_USER}", f"--regid={TEST_USER}", "--clear-groups"]
NO_SYS_ADMIN = ["--bounding-set=-sys_admin"]
NO_CGROUPS = "for m in /sys/fs/cgroup /sys/fs/cgroup/*; do mount -o remount,bind,ro $m; done"
# name: (setpriv arguments for the child, deny it user namespaces?, make Python reachable?,
#        cgroups writable?, mode expected, Landlock ABI the kernel is made to report (None: its own))
MODES = {
    # (a) root with CAP_SYS_ADMIN (this machine).
    "a-root-with-cap-sys-admin": ([], False, False, True, "root-ns", None),
    # (b) a default Docker container: root, CAP_SYS_ADMIN out of the bounding set, user namespaces
    # refused by seccomp; the Python install reachable by others (as in /usr/local).
    "b-root-without-cap-sys-admin": (NO_SYS_ADMIN, True, True, True, "seccomp", None),
    # (b') the same with the Python install below a directory others cannot enter (this machine's
    # /root): the code runs as root with every capability dropped.
    "b-root-no-cap-sys-admin-python-in-root-dir": (NO_SYS_ADMIN, True, False, True, "seccomp", None),
    # ... and with /sys/fs/cgroup read-only, as Docker mounts it: no pids cgroup, and root is exempt
    # from RLIMIT_NPROC, so the code may start no process at all.
    "b-root-no-cap-sys-admin-python-in-root-dir-no-cgroup": (
        NO_SYS_ADMIN, True, False, False, "seccomp", None
    ),
    # (b'') root without CAP_SYS_ADMIN where user namespaces are allowed: the user-ns mode.
    "b-root-no-cap-sys-admin-with-user-namespaces": (NO_SYS_ADMIN, False, True, True, "user-ns", None),
    # (c) a plain user where unprivileged user namespaces work.
    "c-user-with-user-namespaces": (AS_TEST_USER, False, True, True, "user-ns", None),
    # (d) a plain user without them.
    "d-user-without-user-namespaces": (AS_TEST_USER, True, True, True, "seccomp", None),
    # The seccomp modes on a kernel of Landlock ABI 4 (Linux 6.7-6.9: Ubuntu 24.04's 6.8): no signal
    # scope (ABI 6), no IOCTL_DEV right (ABI 5). An older ABI is the one thing faked here.
    "b-root-without-cap-sys-admin-landlock-4": (NO_SYS_ADMIN, True, True, True, "seccomp", 4),
    "b-root-no-cap-sys-admin-python-in-root-dir-landlock-4": (NO_SYS_ADMIN, True, False, True, "seccomp", 4),
    "d-user-without-user-namespaces-landlock-4": (AS_TEST_USER, True, True, True, "seccomp", 4),
}  # fmt: skip


@pytest.mark.parametrize("checkout", ["work", "tmp"])
@pytest.mark.parametrize("name", MODES)
def test_attacks_in_every_mode(name, checkout, checkouts, listener):
    import json
    import subprocess

    setpriv_args, deny_userns, expose, cgroups, expected_mode, landlock_abi = MODES[name]
    missing = [t for t in ("setpriv", "unshare", "useradd") if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"needs root to build the mode's conditions; missing: {missing or 'root'}")
    if TEST_USER in " ".join(setpriv_args):
        subprocess.run(
            ["useradd", "--system", "--no-create-home", TEST_USER], capture_output=True, check=False
        )
    repo = checkouts[checkout]
    shell = (expose_python_shell(repo) if expose else "set -e") + "\n" + ("" if cgroups else NO_CGROUPS)
    shell += '\nexec "$@"'
    child = [sys.executable, f"{repo}/tests/test_sandbox.py", "attacks", str(listener.getsockname()[1])]
    child += ["--deny-user-namespaces"] if deny_userns else []
    child += ["--landlock-abi", str(landlock_abi)] if landlock_abi else []
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", shell, "sh"]
    argv += ["setpriv", *setpriv_args, "--", *child]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": repo, "SANDBOX_TEST_SECRET": SECRET}
    p = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.splitlines()[-1])
    print(name, checkout, json.dumps(report["bombs"]), json.dumps(report["cpus"]))  # figures (pytest -s)
    for path in ("warm", "cold"):  # ... and docs/sandbox.md's: MiB written before the stop
        disk = [mib_written(report["outputs"][f"{path}/{d}"]) for d in ("disk", "disk-unlinked")]
        print(name, checkout, path, disk)
    assert report["mode"] == expected_mode, report
    assert report["gaps"] == [], report["gaps"]
    if expected_mode == "seccomp":  # the start-up line's Landlock part: all of that ABI applied
        abi = landlock_abi or confine.landlock_abi()
        assert report["landlock"].startswith(f"Landlock ABI {abi}: "), report["landlock"]
    if not cgroups:
        assert not report["pids_cgroup"], "the child could make a pids cgroup"
    # Where the code may start no process or thread (uid 0 and nothing to bound them), the trainer says so.
    refused = expected_mode == "seccomp" and not cgroups and not expose
    assert ("the code may start no process or thread" in report["startup"]) == refused, report["startup"]
    check_attacks(report, listener)


def test_trainer_refuses_a_sandbox_that_cannot_contain(tmp_path):
    """Root without CAP_SYS_ADMIN, no user namespaces, and libseccomp's bindings missing: isolation
    'none'. The trainer names what it cannot stop and the flag, before it loads a model or a server."""
    import subprocess

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to drop CAP_SYS_ADMIN")
    argv = ["--model", "models/tiny", "--env", "retool"]
    argv += ["--output-dir", str(tmp_path), "--max-steps", "1"]
    code = (
        "import sys, runpy\nfrom tests.test_sandbox import deny_user_namespaces, isolation_mode\n"
        "from envs import confine\ndeny_user_namespaces()\n"
        "sys.modules['pyseccomp'] = None  # the bindings are not installed\n"
        "isolation_mode.cache_clear(); confine.seccomp_filter.cache_clear()  # probed at import\n"
        f"sys.argv = ['train_async_grpo.py', *{argv!r}]\n"
        "runpy.run_path('train_async_grpo.py', run_name='__main__')"
    )
    cmd = ["setpriv", "--bounding-set=-sys_admin", "--", sys.executable, "-c", code]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "sandbox isolation: none" in p.stdout
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "sandbox isolation 'none' cannot stop network access, reading the trainer's environment"
    )
    assert "--unsafe-sandbox" in last


def test_trainer_refuses_root_without_capabilities_or_landlock(tmp_path):
    """Mode seccomp as root where the code cannot run as a drawn uid (the Python install lies below a
    directory others cannot enter: /root here) on a kernel without Landlock (< 5.13, or left out of
    lsm=; the ABI it reports, 0, is the one thing faked): the code runs as uid 0 without capabilities,
    which still owns every root-owned file. The trainer refuses and names the ways out; with the install
    where others reach it (a drawn uid's permissions only) nothing is refused."""
    import json
    import subprocess

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to drop CAP_SYS_ADMIN")
    if confine.python_reachable_by_others():
        pytest.skip("needs the Python install below a directory others cannot enter")
    no_landlock = (
        "from tests.test_sandbox import deny_user_namespaces, isolation_mode\nfrom envs import confine\n"
        "deny_user_namespaces()\nconfine.landlock_abi = lambda: 0  # a kernel without Landlock\n"
        "confine.landlock_ruleset_rights.cache_clear(); isolation_mode.cache_clear()\n"
    )
    argv = ["--model", "models/tiny", "--env", "retool", "--output-dir", str(tmp_path), "--max-steps", "1"]
    trainer = no_landlock + (
        f"import sys, runpy\nsys.argv = ['train_async_grpo.py', *{argv!r}]\n"
        "runpy.run_path('train_async_grpo.py', run_name='__main__')"
    )
    cmd = ["setpriv", *NO_SYS_ADMIN, "--", sys.executable, "-c", trainer]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "sandbox isolation: seccomp; Landlock ABI 0: not applied" in p.stdout, p.stdout
    last = p.stderr.strip().splitlines()[-1]
    gap = "reading and writing every root-owned file"
    assert last.startswith(f"sandbox isolation 'seccomp' cannot stop {gap}"), last
    assert "a kernel with Landlock" in last and "/usr/local" in last and "--unsafe-sandbox" in last, last
    # The same kernel with the install reachable: the code runs as a drawn uid, and no gap is reported.
    gaps = no_landlock + "from envs.sandbox import isolation_gaps, _draws_uid\n"
    gaps += "import json; print(json.dumps([isolation_mode(), _draws_uid('seccomp'), isolation_gaps()]))"
    shell = expose_python_shell(REPO) + '\nexec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", shell, "sh"]
    cmd += ["setpriv", *NO_SYS_ADMIN, "--", sys.executable, "-c", gaps]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.splitlines()[-1]) == ["seccomp", True, []], p.stdout


@needs_ns
def test_fork_server_outlives_a_full_process_limit():
    """Fork bombs in concurrent warm calls fill the pids cgroup (here of 64), so the fork server's own
    fork for the next call fails: that call fails alone, with one clear line, and the same server
    serves the calls after the bombs (it used to die of the BlockingIOError, failing every call in
    flight with 'no reply')."""
    import json
    import subprocess

    script = (
        "import asyncio, json, os, time\nfrom envs import confine\n"
        "confine.MAX_PIDS = 64  # read as the cgroup is made, on the first call\n"
        "from envs import sandbox as s\n"
        "BOMB = 'import os, time\\nwhile True:\\n    try: os.fork()\\n    except OSError: time.sleep(0.01)'\n"
        "async def main():\n"
        "    sb = s.Sandbox(4)\n"
        "    first = await sb.run('print(1)', timeout_s=30)\n"
        "    cgroup = confine.pids_cgroup(s.MEMORY_BUDGET_BYTES)\n"
        "    if cgroup is None or sb._server is None: return None\n"
        "    server = sb._server.proc.pid\n"
        "    bombs = asyncio.gather(*(sb.run(BOMB, timeout_s=4) for _ in range(3)))\n"
        "    current = lambda: int(open(os.path.join(cgroup[0], 'pids.current')).read())\n"
        "    deadline = time.monotonic() + 3\n"
        "    while current() < 64 and time.monotonic() < deadline: await asyncio.sleep(0.02)\n"
        "    full = current()\n"
        "    innocent = await sb.run('print(2)', timeout_s=30)\n"
        "    bombs = await bombs\n"
        "    after = await sb.run(\"import sys; print('numpy' in sys.modules)\", timeout_s=30)\n"
        "    alive = sb._server.proc.pid == server and sb._server.proc.poll() is None\n"
        "    sb.close()\n"
        "    return [first.output, full, innocent.output + innocent.error,\n"
        "            [b.error for b in bombs], after.output + after.error, alive]\n"
        "print(json.dumps(asyncio.run(main())))"
    )
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.splitlines()[-1])
    if report is None:
        pytest.skip("no pids cgroup can be made here")
    first, full, innocent, bombs, after, alive = report
    assert first == "1\n" and full >= 64, report  # the cgroup was full as the innocent call came
    limit = "no process could be started (process limit reached: other runs hold every process)"
    assert innocent == f"sandbox fork server failed the call: {limit}", report
    assert all(bombs), report  # each bomb ended in its own error (timed out)
    assert after == "True\n" and alive, report  # warm, through the same server


def deny_user_namespaces() -> None:
    """What Docker's default seccomp profile does: unshare() and clone(CLONE_NEWUSER) fail for this
    process and all it starts (clone3 too: its flags are in memory, so it answers ENOSYS and glibc
    falls back to clone)."""
    import errno

    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    f.add_rule(sc.ERRNO(errno.EPERM), "unshare")
    f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 0x10000000, 0x10000000))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.load()


# LANDLOCK ON EVERY ABI: the rights asked for are those the kernel's include/uapi/linux/landlock.h
# gives each ABI, and a kernel that refuses them gets those of the ABI before. Only the ABI the kernel
# reports is faked; each ruleset is created for real on this kernel (ABI 7), which must accept it.

# ABI: (filesystem rights, network rights, scopes), as the kernel header documents each: "available
# since the second/third/fifth version", network "since ABI 4", scopes "since ABI 6"; 7 adds logging.
KERNEL_LANDLOCK = {
    1: (0x1FFF, 0, 0),  # EXECUTE (bit 0) .. MAKE_SYM (bit 12)
    2: (0x3FFF, 0, 0),  # + REFER
    3: (0x7FFF, 0, 0),  # + TRUNCATE
    4: (0x7FFF, 0b11, 0),  # + NET_BIND_TCP, NET_CONNECT_TCP
    5: (0xFFFF, 0b11, 0),  # + IOCTL_DEV
    6: (0xFFFF, 0b11, 0b11),  # + SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL
    7: (0xFFFF, 0b11, 0b11),  # + restrict_self logging flags only
}
needs_landlock_7 = pytest.mark.skipif(
    confine.landlock_abi() < 7, reason=f"needs a kernel of Landlock ABI 7 (ABI {confine.landlock_abi()})"
)


@pytest.fixture
def reported_abi(monkeypatch):
    """Set the Landlock ABI the kernel reports; the answer is probed afresh before and after."""
    confine.landlock_ruleset_rights.cache_clear()
    yield lambda abi: monkeypatch.setattr(confine, "landlock_abi", lambda: abi)
    monkeypatch.undo()
    confine.landlock_ruleset_rights.cache_clear()


@needs_landlock_7
@pytest.mark.parametrize("abi", sorted(KERNEL_LANDLOCK))
def test_landlock_rights_are_those_of_the_reported_abi(abi, reported_abi):
    reported_abi(abi)
    assert confine.landlock_rights(abi) == KERNEL_LANDLOCK[abi]
    # (reported, applied, rights): this kernel accepted a real ruleset with exactly these rights
    assert confine.landlock_ruleset_rights() == (abi, abi, *KERNEL_LANDLOCK[abi])
    assert confine.landlock_description().startswith(
        f"Landlock ABI {abi}: filesystem {KERNEL_LANDLOCK[abi][0]:#x}"
    )


@needs_landlock_7
def test_landlock_ruleset_the_kernel_refuses_is_retried_with_the_abi_before(reported_abi, monkeypatch):
    """A kernel that reports ABI 6 without the signal scope (as RHEL 9's are said to) gets ABI 5's
    rights; one newer than we know gets ABI 7's; one that accepts none gets no Landlock, and says so."""
    real = confine._create_ruleset
    monkeypatch.setattr(
        confine, "_create_ruleset", lambda fs, net, scoped: -22 if scoped else real(fs, net, scoped)
    )
    reported_abi(6)
    assert confine.landlock_ruleset_rights() == (6, 5, *KERNEL_LANDLOCK[5])
    assert "Landlock ABI 6 (refused its rights; those of ABI 5 applied)" in confine.landlock_description()
    confine.landlock_ruleset_rights.cache_clear()
    monkeypatch.setattr(confine, "_create_ruleset", real)
    reported_abi(9)
    assert confine.landlock_ruleset_rights() == (9, 7, *KERNEL_LANDLOCK[7])
    confine.landlock_ruleset_rights.cache_clear()
    monkeypatch.setattr(confine, "_create_ruleset", lambda fs, net, scoped: -22)
    assert confine.landlock_ruleset_rights() == (9, 0, 0, 0, 0)
    assert confine.landlock_description() == "Landlock ABI 9: not applied (no ruleset accepted)"


# ONE MEMORY BUDGET FOR ALL RUNS


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_eight_memory_creepers_share_one_budget(warm):
    from envs.confine import memory_cgroup

    budget = 512 * 1024**2
    cgroup = memory_cgroup(budget)
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here (not root, or no memory controller)")
    sandbox = Sandbox(max_concurrency=8, memory_budget_bytes=budget, warm=warm)
    # Each wants 1 GiB (under RLIMIT_AS), written so every page is charged; together 8 GiB.
    code = "import time\nx = []\nfor _ in range(64):\n    x.append(b'x' * (16 << 20))\n    time.sleep(0.02)\n"
    code += "print('survived')"

    async def eight():
        return await asyncio.gather(*(sandbox.run(code, timeout_s=60) for _ in range(8)))

    results = asyncio.run(eight())
    assert all("out of memory" in r.error and "survived" not in r.output for r in results), [
        (r.exit_code, r.error, r.output[-200:]) for r in results
    ]
    peak = "memory.max_usage_in_bytes" if cgroup[1] == "v1" else "memory.peak"
    with open(os.path.join(cgroup[0], peak)) as f:
        assert int(f.read()) <= budget
    assert str(os.getpid()) not in open(os.path.join(cgroup[0], "cgroup.procs")).read().split()


def test_disk_watcher_looks_for_deleted_files_as_the_disk_fills(tmp_path, monkeypatch):
    """Files unlinked while kept open are found by a process table, too dear for every poll: the
    watcher looks for them as soon as the filesystem has grown by more than the cap could hide; space
    others free meanwhile does not hide the run's writing; a look is no verdict (what others write is
    not the run's). The regular looks are off here: only the growth can send the watcher looking."""
    import subprocess

    from envs import diskwatch

    monkeypatch.setattr(diskwatch, "DELETED_POLL_EVERY", 10**6)
    run_dir, elsewhere = tmp_path / "base" / "run", tmp_path / "elsewhere"
    run_dir.mkdir(parents=True)
    # 4 MiB every 50 ms into files unlinked at once, up to 512 MiB, once told to start.
    writer = (
        "import os, sys, time\nsys.stdin.readline()\nkept = []\nfor i in range(128):\n"
        "    f = open(f'f{i}', 'wb'); os.unlink(f'f{i}'); kept.append(f)\n"
        "    f.write(b'x' * (4 << 20)); f.flush(); time.sleep(0.05)\ntime.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=run_dir, stdin=subprocess.PIPE)
    stopped, full, held_at_full = threading.Event(), threading.Event(), []

    def watch() -> None:  # diskwatch.main's loop, for this one run
        looks = diskwatch.over_the_cap(str(run_dir), proc.pid, None)
        while not stopped.wait(diskwatch.DISK_POLL_S):
            if next(looks):
                held_at_full.append(confine.deleted_bytes(proc.pid, None))
                full.set()
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with open(elsewhere, "wb") as f:  # others fill the disk: the run holds nothing
            for _ in range(32):
                f.write(b"x" * (4 << 20))
                f.flush()
                time.sleep(0.01)
        time.sleep(0.2)
        assert not full.is_set(), "killed a run for what others wrote"
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        time.sleep(0.1)
        os.unlink(elsewhere)  # others free 128 MiB as the run writes: that hides one poll's writing at most
        assert full.wait(20), "the files the run unlinked were never found"
    finally:
        stopped.set()
        proc.kill()
        proc.wait()
        watcher.join()
    print("MiB held when found:", held_at_full[0] >> 20)
    # Found within a poll of the cap (80 MiB/s: under 1 MiB a poll), with 800 ms to spare for a loaded
    # machine; a look deferred until the disk had grown by twice the cap finds ~136 MiB.
    assert confine.MAX_DIR_BYTES < held_at_full[0] < 2 * confine.MAX_DIR_BYTES, held_at_full


def test_the_disk_cap_holds_while_the_trainers_threads_are_busy(monkeypatch):
    """The disk watcher of the modes without a tmpfs shared the trainer's GIL as a thread of it: with
    Python threads of ours busy, each of its reads waited for the GIL, a look took up to a second,
    and the disk attacks wrote 0.6-1.5 GiB past the 64 MiB cap. A process of its own
    (envs/diskwatch.py), enlisted by each run before its code starts, holds the bound whatever our
    threads do (here: 1.5 GiB written, unkilled, before it; 64-96 MiB after). The mode is forced
    (the modes' own conditions: test_attacks_in_every_mode); none watches the same way."""
    from envs import sandbox

    mode = "seccomp" if confine.seccomp_filter() is not None else "none"
    monkeypatch.setattr(sandbox, "isolation_mode", lambda: mode)
    busy = True

    def spin() -> None:
        while busy:
            pass

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(8)]
    for t in spinners:
        t.start()
    try:
        results = {
            d: asyncio.run(sandbox.run_python(ATTACKS[d], timeout_s=60)) for d in ("disk", "disk-unlinked")
        }
    finally:
        busy = False
        for t in spinners:
            t.join()
    for name, r in results.items():
        print(mode, name, "MiB written:", mib_written(r.output), f"{r.duration_s:.1f} s")
        assert "to disk, or what it holds could not be told: killed (the sandbox's disk cap)" in r.error, (
            r.error,
            r.output[-300:],
        )
        assert mib_written(r.output) <= DISK_WRITTEN_MAX_MIB, r.output[-300:]


if __name__ == "__main__" and sys.argv[1] == "attacks":
    # The child of test_attacks_in_every_mode, already under the mode's privileges.
    import json

    os.setsid()  # our process group holds us and the sleeper only: the signal attack aims at it
    if "--landlock-abi" in sys.argv:  # what an older kernel answers; probed once, like the mode
        from envs import confine

        abi = int(sys.argv[sys.argv.index("--landlock-abi") + 1])
        confine.landlock_abi = lambda: abi
        confine.landlock_ruleset_rights.cache_clear()
    if "--deny-user-namespaces" in sys.argv:
        deny_user_namespaces()
    isolation_mode.cache_clear()  # probed at this module's import, before the filter
    print(json.dumps(attack_suite(int(sys.argv[2]))))


def warm_and_cold(code: str, timeout_s: float) -> list:
    """`code`'s results through a warm and a cold Sandbox."""
    warm, cold = Sandbox(1), Sandbox(1, warm=False)

    async def both():
        return [await sandbox.run(code, timeout_s=timeout_s) for sandbox in (warm, cold)]

    try:
        return asyncio.run(both())
    finally:
        warm.close()
        cold.close()


@needs_ns
@pytest.mark.parametrize(
    "code", ["print('first')\nraise ValueError('then')", "print('first')\nimport sys\nsys.exit('a message')"]
)
def test_warm_and_cold_paths_report_the_same_output_and_exit_code(code):
    """What the model reads back of a failing program: the warm path printed the traceback before the
    code's own prints (stdout, block-buffered, was flushed after it), named the file `main.py` where
    Python says `/sandbox/main.py`, and gave sys.exit("message") status 0."""
    w, c = warm_and_cold(code, timeout_s=30)
    assert w.output.startswith("first\n") and (w.output, w.exit_code) == (c.output, c.exit_code) == (
        c.output,
        1,
    )


ENDINGS = {  # code: what `python main.py` prints
    "import atexit\natexit.register(print, 'at exit')\nprint('main')": "main\nat exit\n",
    "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
    "print('main')": "main\nthread\n",
    "import threading\nthreading.Thread(target=threading.Event().wait).start()\nprint('main')": "main\n",
}


@needs_ns
@pytest.mark.parametrize("code", ENDINGS, ids=["atexit", "thread", "stuck-thread"])
def test_the_warm_path_ends_the_code_as_python_does(code):
    """A program's end as `python main.py` has it: its non-daemon threads waited for, then its atexit
    callbacks run, what it printed flushed first. The warm path's child left by os._exit at the end of
    the main module: a thread's and a callback's prints were lost, and a run killed at its timeout
    while a thread held it said nothing of what its main module had printed."""
    w, c = warm_and_cold(code, timeout_s=2)
    stuck = "Event().wait" in code
    assert (c.output, c.exit_code, c.timed_out) == (ENDINGS[code], 137 if stuck else 0, stuck), c
    assert (w.output, w.exit_code, w.timed_out) == (c.output, c.exit_code, c.timed_out), w


def test_a_run_whose_disk_watcher_dies_is_killed_and_the_next_run_watched(monkeypatch):
    """The disk watcher is a process (envs/diskwatch.py): should it die, the runs it watched can write
    unmeasured, so they are killed at once, saying so; every run after starts another watcher. One
    that cannot start fails its run in one line, run after run."""
    from envs import sandbox

    mode = "seccomp" if confine.seccomp_filter() is not None else "none"
    monkeypatch.setattr(sandbox, "isolation_mode", lambda: mode)
    code = "import time\nprint('started', flush=True)\ntime.sleep(30)\nprint('ran on')"

    async def watcher_killed_under_a_run():
        call = asyncio.ensure_future(sandbox.run_python(code, timeout_s=60))
        await asyncio.sleep(1.5)  # the code runs, under the watcher its run started (or found)
        watchers.append(sandbox._DISK_WATCHER._proc)
        watchers[-1].kill()
        return await call

    watchers = []
    for _ in range(2):  # the second run's watcher is a new process
        result = asyncio.run(watcher_killed_under_a_run())
        assert "ran on" not in result.output and result.duration_s < 20, result
        assert "killed (the sandbox's disk cap)" in result.error, result
    assert watchers[0] is not watchers[1]
    ok = asyncio.run(sandbox.run_python("print('fine')", timeout_s=30))
    assert ok.output == "fine\n" and not ok.error, ok

    monkeypatch.setattr(sandbox._DISK_WATCHER, "_proc", None)
    monkeypatch.setattr(sandbox.sys, "executable", "/bin/false")  # a watcher that never says "ready"
    for _ in range(3):
        failed = asyncio.run(sandbox.run_python("print('fine')", timeout_s=30))
        assert failed.error == "sandbox failed to start: the disk watcher (envs/diskwatch.py) did not start"
        assert failed.exit_code is None and failed.output == ""


def test_a_forked_child_watches_its_runs_with_a_watcher_of_its_own(monkeypatch):
    """rollout_process.py forks the trainer: a child that used its parent's watcher got no answer to
    its runs (they went to the parent's reader), waited 10 s on each and missed the disk-cap kill."""
    import multiprocessing

    from envs import sandbox

    mode = "seccomp" if confine.seccomp_filter() is not None else "none"
    monkeypatch.setattr(sandbox, "isolation_mode", lambda: mode)
    assert asyncio.run(sandbox.run_python("print('parent')", timeout_s=30)).output == "parent\n"

    def child(results) -> None:
        r = asyncio.run(sandbox.run_python(ATTACKS["disk"], timeout_s=60))
        results.put((r.error, r.duration_s, sandbox._DISK_WATCHER._proc.pid))

    results = multiprocessing.get_context("fork").Queue()
    proc = multiprocessing.get_context("fork").Process(target=child, args=(results,))
    proc.start()
    error, duration_s, watcher = results.get(timeout=120)
    proc.join(30)
    assert "killed (the sandbox's disk cap)" in error and duration_s < 10, (error, duration_s)
    assert watcher != sandbox._DISK_WATCHER._proc.pid


def test_the_watcher_drops_a_run_that_is_over_without_its_stop(tmp_path):
    """A run whose "stop" never comes (its event loop closed, its clock thread killed it and removed its
    dir) is dropped once its dir and its first process are gone: a pid reused later, or a new dir at
    the same path, is not that run's. Talks to envs/diskwatch.py's process directly."""
    import subprocess

    source = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom envs import diskwatch\ndiskwatch.main()"
    watcher = subprocess.Popen(
        [sys.executable, "-I", "-c", source], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )

    def say(line: str) -> None:
        watcher.stdin.write(f"{line}\n".encode())
        watcher.stdin.flush()

    def looked() -> list[bytes]:
        """What it reported until it had looked at every run at least once more (commands are read
        before each round of looks: the second answer comes after a whole round)."""
        said = []
        for ping in ("ping1", "ping2"):
            say(f"stop {ping}")
            while (line := watcher.stdout.readline()) != f"stopped {ping}\n".encode():
                said.append(line)
        return said

    try:
        assert watcher.stdout.readline() == b"ready\n"
        gone = subprocess.Popen(["true"])
        gone.wait()
        run_dir = tmp_path / "base" / "run"
        for run_id, over in (("1", False), ("2", True)):
            run_dir.mkdir(parents=True)
            say(f"watch {run_id} {gone.pid} -1 0 {run_dir}")
            assert looked() == []
            if not over:  # the run ends: its dir removed, no "stop"; then a new dir at that path fills
                shutil.rmtree(run_dir)
                assert looked() == []
                run_dir.mkdir(parents=True)
            for i in range(5):
                (run_dir / f"f{i}").write_bytes(os.urandom(16 << 20))
            # The control: a run still on is caught (its first process gone, its dir there).
            assert looked() == ([b"full 2\n"] if over else []), run_id
            shutil.rmtree(run_dir)
    finally:
        watcher.kill()
        watcher.wait()
