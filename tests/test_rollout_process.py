"""The rollout worker in its own process (rollout_process.py), against the session's real vLLM server:
the trainer's interface over the process boundary (groups, versions, discards, counters, exhaustion,
stop), its CPU placement, and a child that dies or cannot start being seen as dead."""

import functools
import os
import queue
import time

import pytest

import train_async_grpo
from envs.confine import ROLLOUT_CPUS_ENV
from envs.data import load_rows
from rollout_process import RolloutProcess, build_worker

REPO = train_async_grpo.Path(__file__).resolve().parent.parent


def _args(model, *extra: str):
    return train_async_grpo.parser.parse_args(
        ["--model", str(model), "--env", "retool", "--num-generations", "2", "--max-turns", "2",
         "--max-context", "512", "--prompts-per-step", "1", "--max-staleness", "0", "--sandbox-workers", "2",
         "--seed", "3", *extra]
    )  # fmt: skip


def _cannot_build(*, expected_version):
    raise RuntimeError("no tokenizer here")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_trainers_interface_over_the_process_boundary(vllm_server, served_model, monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv(ROLLOUT_CPUS_ENV, str(cpus[-1]))
    rows = load_rows(str(REPO / "data" / "retool_train.jsonl"))[:3]
    # The trainer's own builder; one group per version, no staleness: a group is admitted only once the
    # trainer reached the next version, or discarded one.
    build = functools.partial(
        build_worker, _args(served_model), None, [vllm_server.url], str(served_model),
        rows, 0, [], 0, "envs.retool",
    )  # fmt: skip
    version = {"v": 0}
    worker = RolloutProcess()
    worker.build(build, lambda: version["v"], start_version=0)
    try:
        assert worker.alive and worker._proc.pid != os.getpid()
        deadline = time.monotonic() + 60  # it pins itself first thing, once its interpreter is up
        while os.sched_getaffinity(worker._proc.pid) != {cpus[-1]} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.sched_getaffinity(worker._proc.pid) == {cpus[-1]}
        with pytest.raises(queue.Empty):
            worker.queue.get(timeout=2.0)  # built by now, it admits nothing before start() (counted below)
        assert worker.stats.groups_started == 0
        worker.start()
        first = worker.queue.get(timeout=300)
        assert first.admitted_version == 0 and len(first.completions) == 2
        with pytest.raises(queue.Empty):
            worker.queue.get(timeout=2.0)  # version 0 admits one group only (a start shows in 0.2 s)
        assert worker.stats.groups_started == 1 and worker.client.stats.requests >= 2

        version["v"] = 1
        worker.set_version(1)
        second = worker.queue.get(timeout=300)
        assert second.admitted_version == 1
        worker.discard(1)  # the trainer threw one away: a replacement is admitted at the same version
        third = worker.queue.get(timeout=300)
        assert third.admitted_version == 1 and third.row["_index"] == 2
        time.sleep(2 * 0.2)  # the counters are at most a report period old
        assert worker.stats.groups_discarded == 1 and worker.stats.groups_done == 3
        with pytest.raises(queue.Empty):
            worker.queue.get(timeout=2.0)  # 2 live groups at version 1, no staleness: nothing more
    finally:
        t0 = time.monotonic()
        worker.stop(timeout_s=5.0)
        stop_s = time.monotonic() - t0
    assert not worker.alive and stop_s < 10.0
    assert worker.stats.groups_started == 3  # the final report came through


def test_a_rollout_process_that_cannot_build_its_worker_is_seen_dead():
    worker = RolloutProcess()
    worker.build(_cannot_build, lambda: 0, start_version=0)
    deadline = time.monotonic() + 60
    while worker.alive and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker.alive
    with pytest.raises(queue.Empty):
        worker.queue.get(timeout=0.1)
    worker.stop(timeout_s=1.0)


class _OneHugeGroup:
    """A worker whose one group is larger than a pipe holds: the child's queue is still writing it when
    the child dies."""

    def __init__(self):
        import types

        from rollout import ClientStats, WorkerStats

        self.queue: queue.Queue = queue.Queue()
        self.queue.put(b"x" * (64 << 20))
        self.stats, self.alive, self.exhausted = WorkerStats(), True, False
        self.client = types.SimpleNamespace(stats=ClientStats(), down=set())

    def start(self) -> None:
        pass

    def set_version(self, version: int) -> None:
        pass

    def discard(self, n: int) -> None:
        pass

    def stop(self, timeout_s: float) -> None:
        self.alive = False


def _build_one_huge_group(*, expected_version):
    return _OneHugeGroup()


def _blocked_in_a_write(build) -> RolloutProcess:
    """A started rollout process whose worker (`build`) has one group larger than a pipe holds, once the
    child reported it sent: its queue's feeder thread is then blocked in the write."""
    worker = RolloutProcess()
    worker.build(build, lambda: 0, start_version=0)
    worker.start()
    deadline = time.monotonic() + 60
    while worker._groups_sent < 1 and time.monotonic() < deadline:  # from its reports
        worker._read_reports()
        time.sleep(0.1)
    assert worker._groups_sent == 1
    time.sleep(0.5)  # the feeder thread is in the write by now: the pipe holds 64 KiB
    return worker


@pytest.mark.timeout(120)
def test_a_child_killed_mid_message_is_seen_dead_not_waited_for():
    """The child dies (SIGKILL, out of memory) halfway through writing a group into the pipe: the
    trainer's next read meets the end of the pipe and sees the child dead, instead of waiting forever
    for the rest of the message (the trainer held the pipe's write end too, so the end never came)."""
    import signal
    import threading

    worker = _blocked_in_a_write(_build_one_huge_group)
    os.kill(worker._proc.pid, signal.SIGKILL)
    worker._proc.join(10)
    outcome: list = []

    def read() -> None:
        try:
            outcome.append(worker.queue.get(timeout=1.0))
        except queue.Empty:
            outcome.append("empty")
        worker.stop(timeout_s=1.0)
        outcome.append("stopped")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    assert outcome == ["empty", "stopped"] and not worker.alive, outcome


class _SlowToDiscard(_OneHugeGroup):
    """A worker with no groups whose discard takes 0.5 s (it counts them as the real one does)."""

    def __init__(self):
        super().__init__()
        self.queue = queue.Queue()

    def discard(self, n: int) -> None:
        time.sleep(0.5)
        self.stats.groups_discarded += n


def _build_slow_to_discard(*, expected_version):
    return _SlowToDiscard()


@pytest.mark.timeout(120)
def test_a_discard_made_while_the_child_applies_one_is_applied_too():
    """The trainer discards while the child is passing an earlier discard to its worker: both reach it
    (each frees an admission slot; one lost is a slot lost for the run, and at --max-staleness 0 a step
    that never fills). The child read the shared count again after applying it, skipping the new one."""
    worker = RolloutProcess()
    worker.build(_build_slow_to_discard, lambda: 0, start_version=0)
    worker.start()
    try:
        worker.discard(1)
        time.sleep(0.2)  # the child is inside the worker's discard by now (it polls every ~5 ms)
        worker.discard(1)
        deadline = time.monotonic() + 30
        while worker.stats.groups_discarded < 2 and time.monotonic() < deadline:
            worker._read_reports()
            time.sleep(0.1)
        assert worker.stats.groups_discarded == 2
    finally:
        worker.stop(timeout_s=5.0)


def _build_then_die_holding_the_shared_locks(*, expected_version):
    """In the child: take every lock it shares with the trainer, as reading a locked value or an event
    does for an instant on each pass of its loop, and be killed (SIGKILL) in that instant."""
    import signal
    import sys

    shared = sys._getframe(1).f_locals["shared"]  # _child_main's: what it shares with the trainer
    for obj in shared:
        if hasattr(obj, "get_lock"):  # multiprocessing's Value(lock=True)
            obj.get_lock().acquire()
        if hasattr(obj, "_cond"):  # multiprocessing's Event
            obj._cond.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_child_killed_holding_a_shared_lock_does_not_hang_the_trainer():
    """It was a deadlock: the discard count was a locked shared value and the start/stop flags were
    multiprocessing events, whose locks the child takes to read them. A child killed (out of memory)
    in that instant never released the lock, and the trainer's next discard() or stop() waited on it
    forever. Nothing shared has a lock now: the trainer writes, the child reads."""
    import threading

    worker = RolloutProcess()
    worker.build(_build_then_die_holding_the_shared_locks, lambda: 0, start_version=0)
    worker._proc.join(60)
    assert not worker.alive
    done: list = []

    def trainer() -> None:
        worker.set_version(1)
        worker.discard(1)
        done.append("discarded")
        worker.start()
        worker.stop(timeout_s=1.0)
        done.append("stopped")

    caller = threading.Thread(target=trainer, daemon=True)
    caller.start()
    caller.join(30)
    assert done == ["discarded", "stopped"], f"the trainer hung on a lock the killed child held after {done}"


class _HugeGroupThenHugeReport(_OneHugeGroup):
    """A worker whose last words are large: its one group fills the pipe, and stopping it records 200k
    failed rows (the final report, ~1 MB pickled, is larger than a pipe holds too)."""

    def stop(self, timeout_s: float) -> None:
        self.stats.failed_rows = list(range(200_000))
        self.alive = False


def _build_huge_group_then_huge_report(*, expected_version):
    return _HugeGroupThenHugeReport()


@pytest.mark.timeout(300)
def test_a_stopped_child_delivers_its_last_group_and_report_whole():
    """stop() with a group still in the child's queue feeder (blocked on the full pipe) and a final
    report larger than the pipe: the child flushes both before it exits, so the trainer sees the final
    counters (the failed rows a resume must count as used). An exit that does not wait for its queues'
    feeder threads cuts both, and the trainer keeps the report before it. The stop's timeout is generous:
    under make test's quick pass (niced, beside two slow streams) the child gets a sliver of a core to
    pickle its 200,000 rows (killed at 5 + 5 s in one CI run), and what is asserted is that it exits
    on its own with everything delivered, not how fast."""
    worker = _blocked_in_a_write(_build_huge_group_then_huge_report)
    worker.stop(timeout_s=60.0)
    assert not worker.alive and worker._proc.exitcode == 0
    assert worker.stats.failed_rows == list(range(200_000))


TRAINER_WHOSE_CHILD_DIED_BEFORE_ITS_BUILD = """
import functools, os, signal, sys
sys.path.insert(0, sys.argv[1])
from rollout_process import RolloutProcess
from tests.test_rollout_process import _cannot_build_from
worker = RolloutProcess()
os.kill(worker._proc.pid, signal.SIGKILL)  # out of memory while the servers start, say
worker._proc.join(10)
rows = [{"question": f"{i} + {i}?", "answer": str(2 * i)} for i in range(5000)]  # ~200 KB pickled
worker.build(functools.partial(_cannot_build_from, rows), lambda: 0, start_version=0)
worker.stop(timeout_s=1.0)
print("stopped", flush=True)
"""


def _cannot_build_from(rows, *, expected_version):
    raise RuntimeError("no tokenizer here")


@pytest.mark.timeout(300)
def test_a_trainer_whose_child_died_before_its_build_still_exits():
    """The build carries the dataset's rows (the retool set: 160 KB), more than a pipe holds. With the
    child dead before it read them, the queue's feeder thread waits in that write forever, and Python's
    exit joined it: the trainer hung after its last line instead of exiting."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER_WHOSE_CHILD_DIED_BEFORE_ITS_BUILD, str(REPO)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=150)  # imports take ~20 s on a loaded 2-core machine
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the trainer did not exit 150 s after it started; it printed: {out[-2000:]!r}")
    assert proc.returncode == 0 and "stopped" in out, out[-2000:]
