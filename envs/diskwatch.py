"""The disk watcher of the modes whose run dir lies on the machine's disk (seccomp, none: no tmpfs can
be mounted), where RLIMIT_FSIZE bounds each file but not how many (640 MiB in 0.2 s were seen). A
process of its own, one per trainer process, started and fed by envs/sandbox.py (`_DiskWatcher`): a
run over confine.MAX_DIR_BYTES is killed here, then reported.

Why a process and not a thread of the trainer: every read a look makes (a stat per file, a process
table) gives the GIL up and waits to take it back, and the trainer's own threads hold it. With one busy
Python thread beside it a look at a run dir took 0.17-0.5 s and one at the process table ~1 s; with
three, runs wrote 0.6-1.2 GiB past the 64 MiB cap and took 3-7 s to be killed
(tests/test_sandbox.py::test_the_disk_cap_holds_while_the_trainers_threads_are_busy).

Lines on stdin: "watch ID FIRST UID REAPER RUN_DIR" (UID -1: no drawn uid; REAPER 1: FIRST is
`_REAPER`, killed by envs/sandbox.py, last), written by the run's first process before it execs;
"stop ID". On stdout: "ready" once; "full ID" for a run found over the cap (or whose holdings cannot
be told), once it is killed; "stopped ID", the answer to "stop". A run whose dir and first process
are both gone is dropped unasked. Ends with its stdin or its parent.
"""

import os
import select
import signal
import time
from collections.abc import Iterator

from envs import confine

DISK_POLL_S = 0.01  # how often a run dir is measured (~20 µs for a few files)
DELETED_POLL_EVERY = 10  # ... and at least every so many times the deleted files it holds (~3 ms)


def over_the_cap(run_dir: str, first: int, uid: int | None) -> Iterator[bool]:
    """One look per `next`: is the run over MAX_DIR_BYTES, or can what it holds not be told
    (`confine.dir_bytes`, `confine.deleted_bytes`)? Files deleted while open cost a process table to
    find: they are looked for every DELETED_POLL_EVERY looks, and sooner once what the run held at the
    last look plus what its filesystem has grown by since (one statfs a look, everyone's writes) passes
    the cap. Space another process frees within the same look hides as much of the run's writing until
    the next regular look."""
    temp_dir = os.path.dirname(os.path.dirname(run_dir))  # run_dir's filesystem; the code cannot remove it
    looks, unknown, grown, last_used, held_then = 0, 0, 0, None, 0
    while True:
        used = confine.fs_used(temp_dir)  # before the dir: a write in between counts twice, never not at all
        grown += 0 if used is None or last_used is None else max(used - last_used, 0)
        last_used = used
        held = confine.dir_bytes(run_dir)
        due = looks % DELETED_POLL_EVERY == 0 or unknown or used is None
        if held is not None and (due or held_then + grown > confine.MAX_DIR_BYTES):
            deleted = confine.deleted_bytes(first, uid)
            # A process in an exec or on its way out refuses these reads for a moment (seen: one look
            # in ~50 runs); one that stays unreadable (made itself non-dumpable) is "cannot tell".
            unknown = unknown + 1 if deleted is None else 0
            held = None if unknown >= 3 else held + (deleted or 0)
            grown, held_then = 0, held or 0
        looks += 1
        yield held is None or held > confine.MAX_DIR_BYTES


def kill(first: int, uid: int | None, reaper: bool) -> None:
    """Stop the run writing: every process of it but a reaper `first`, which envs/sandbox.py ends
    (killed now, it would hand what is left to init)."""
    confine.kill_until_gone(first, uid, time.monotonic() + 1)
    if not reaper:
        try:
            os.killpg(first, signal.SIGKILL)  # its process group: the code's first process is its id
        except OSError:
            pass


def main() -> None:
    parent, pending = os.getppid(), b""
    watches: dict[str, tuple[Iterator[bool], int, int | None, bool, str]] = {}
    os.write(1, b"ready\n")
    while os.getppid() == parent:
        if select.select([0], [], [], DISK_POLL_S)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                words = line.decode().split(" ", 5)
                if words[0] == "watch":
                    run_id, first, uid, reaper, run_dir = words[1:]
                    owner = None if int(uid) < 0 else int(uid)
                    looks = over_the_cap(run_dir, int(first), owner)
                    watches[run_id] = (looks, int(first), owner, reaper == "1", run_dir)
                elif words[0] == "stop":  # answered after any "full" of the run: one pipe keeps the order
                    watches.pop(words[1], None)
                    os.write(1, f"stopped {words[1]}\n".encode())
        for run_id, (looks, first, uid, reaper, run_dir) in list(watches.items()):
            if not os.path.isdir(run_dir) and not os.path.exists(f"/proc/{first}"):
                del watches[run_id]  # the run is over, its dir removed, yet its "stop" never came
            elif next(looks):
                kill(first, uid, reaper)
                del watches[run_id]
                os.write(1, f"full {run_id}\n".encode())
