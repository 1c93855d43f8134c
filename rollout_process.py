"""The rollout worker in a process of its own, so that its work never lands on the trainer's GIL or core.

In one process, the rollout thread (asyncio, aiohttp, JSON, the tool loop, sandbox bookkeeping,
scoring) held the GIL about a third of the time and the trainer's steps took twice as long with
rollouts running beside them. Here the same `rollout.AsyncRolloutWorker` runs in a forked child,
pinned to --rollout-cpus with everything it starts; the trainer sees the interface it had:

- `queue.get(timeout)` gives the next scored `RolloutGroup` (queue.Empty on timeout);
- `set_version(v)` / `discard(n)` go to the child through shared integers (admission reads them);
- `stats`, `client.stats`, `client.down`, `exhausted` are the child's latest report (≤ 0.2 s old);
- `alive` is the child process; `stop()` returns within its timeout whatever the child does.

The child is forked when this object is made, which the trainer does first thing, before it has a
thread, a CUDA context, a server or a model (later, fork would copy the locks of the trainer's threads
and its CUDA state; the one other thread then, numpy's OpenBLAS pool, is rebuilt in a forked child by
OpenBLAS itself). Forked, it has the trainer's modules imported; a spawned interpreter spent ~4.5 s of
CPU importing torch and transformers again. `build(...)` then hands it a picklable
`build(expected_version) -> AsyncRolloutWorker` (the trainer's `build_worker` below, which loads the
tokenizer and the env the same way the trainer does); it waits for `start()` before it admits a group,
so the build overlaps the trainer's start-up eval. It dies with the trainer, however the trainer dies
(PR_SET_PDEATHSIG), and takes its sandbox runs and answer-checking workers with it (theirs are set the
same way).
"""

import argparse
import atexit
import copy
import importlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from batches import row_stream
from envs import episodes_of, verify
from envs.confine import ROLLOUT_CPUS_ENV, die_with_parent, parse_cpus, pin_to_rollout_cpus
from lora import adapter_name
from rollout import AsyncRolloutWorker, ClientStats, VLLMClient, WorkerStats
from trainer import load_tokenizer, sampling_of

logger = logging.getLogger(__name__)

REPORT_EVERY_S = 0.2  # how stale the trainer's view of the child's counters may be


@dataclass
class Report:
    """The child's counters, sent when they change. `groups_sent` lets the trainer tell "all rows used
    and every group delivered" from "the last groups are still in the pipe"."""

    stats: WorkerStats
    client_stats: ClientStats
    down: set[str]
    exhausted: bool
    groups_sent: int


@dataclass
class ClientView:
    """What the trainer reads of the child's VLLMClient; `expected_version` is the trainer's own getter
    (the weight version servers must report before the client routes to them)."""

    expected_version: Callable[[], object]
    stats: ClientStats = field(default_factory=ClientStats)
    down: set[str] = field(default_factory=set)


class RolloutProcess:
    def __init__(self, stop_timeout_s: float = 10.0):
        ctx = mp.get_context("fork")  # made before the trainer has threads or CUDA: see the docstring
        self._client = ClientView(lambda: 0)
        self._stats = WorkerStats()
        self._exhausted, self._groups_sent, self._groups_received = False, 0, 0
        self._builds = ctx.Queue()  # the one build, sent once the servers are up
        # The build carries the dataset's rows, more than a pipe holds: with the child dead before it read
        # them, the feeder thread waits in that write forever, and our exit would join it (a hang).
        self._builds.cancel_join_thread()
        self._groups = ctx.Queue()  # bounded by admission, as the thread worker's queue is
        self._reports = ctx.Queue()
        # Shared words without a lock: the trainer's thread alone writes them, the child only reads (an
        # aligned 8-byte word is read and written whole). A lock (a locked Value, an Event's) is taken by
        # the child to read it, and one it held when it was killed (out of memory) was never released:
        # the trainer's next discard() or stop() waited on it forever.
        self._version = ctx.Value("q", 0, lock=False)
        self._expected = ctx.Value("q", 0, lock=False)
        self._discarded = ctx.Value("q", 0, lock=False)
        self._go, self._stopping = ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)
        shared = (self._version, self._expected, self._discarded, self._go, self._stopping)
        self._proc = ctx.Process(
            target=_child_main,
            args=(self._builds, os.getpid(), self._groups, self._reports, shared, stop_timeout_s),
            name="rollout-worker",
            daemon=True,
        )
        self._proc.start()
        # A trainer that exits before stop() (a start-up that fails: a refused sandbox, a model that
        # does not load) would wait forever in multiprocessing's exit for a child that ignores the
        # SIGTERM it sends: killed first. This runs before that wait (atexit runs last-in first-out).
        self._trainer_pid = os.getpid()
        atexit.register(self._kill_if_alive)
        # Only the child writes groups and reports. With our copies of the write ends closed, a child
        # that dies halfway through a message (SIGKILL, out of memory) leaves the end of the pipe behind
        # it, which our read raises (EOFError), instead of a read waiting forever for the rest.
        for q in (self._groups, self._reports):
            q._writer.close()
        self.built = False
        self.queue = self  # the trainer takes groups with `worker.queue.get(timeout=...)`

    # --- called from the trainer thread ---------------------------------------------------------------
    def build(self, build: Callable, expected_version: Callable[[], int], start_version: int) -> None:
        """The child builds its worker with `build`: the version it admits from, and the trainer's
        getter of the weight version servers must report before the client routes to them."""
        self._client.expected_version = expected_version
        self._version.value, self._expected.value = start_version, expected_version()
        self._builds.put(build)  # by the queue's feeder thread: the trainer never blocks on the pipe
        self.built = True

    def start(self) -> None:
        self._go.value = 1

    def set_version(self, version: int) -> None:
        self._expected.value = self._client.expected_version()
        self._version.value = version

    def discard(self, n: int = 1) -> None:
        self._discarded.value += n

    def get(self, timeout: float):
        self._read_reports()  # also while the trainer only waits: a dead child must be seen as dead
        try:
            group = self._groups.get(timeout=timeout)
        except (EOFError, OSError):  # the child died mid-message: `alive` says so
            time.sleep(timeout)  # as an empty queue would have waited: callers poll on Empty
            raise queue.Empty from None
        self._groups_received += 1
        return group

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exhausted(self) -> bool:
        self._read_reports()
        return self._exhausted and self._groups_received == self._groups_sent

    @property
    def stats(self) -> WorkerStats:
        self._read_reports()
        return self._stats

    @property
    def client(self) -> ClientView:
        self._read_reports()
        return self._client

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the child to stop (it cancels its requests and tools within its own timeout), keep
        reading its reports meanwhile (a full pipe would block its exit), then kill it if it lingers."""
        self._stopping.value = 1
        self._go.value = 1
        deadline = time.monotonic() + timeout_s + 5.0
        while self._proc.is_alive() and time.monotonic() < deadline:
            self._read_reports()
            try:
                self._groups.get(timeout=0.1)  # undelivered groups are dropped: the run is ending
            except (queue.Empty, EOFError, OSError):
                pass
        if self._proc.is_alive():
            logger.error("rollout process still alive %.1f s after stop(); killing it", timeout_s + 5.0)
            self._proc.kill()
        self._proc.join(5.0)
        self._read_reports()

    def _kill_if_alive(self) -> None:
        if os.getpid() == self._trainer_pid and self._proc.is_alive():  # not in a forked child of ours
            self._proc.kill()
            self._proc.join(5.0)

    def _read_reports(self) -> None:
        while True:
            try:
                report: Report = self._reports.get_nowait()
            except (queue.Empty, EOFError, OSError, ValueError):
                return
            self._stats, self._exhausted, self._groups_sent = (
                report.stats,
                report.exhausted,
                report.groups_sent,
            )
            self._client.stats, self._client.down = report.client_stats, report.down


def split_cpus(rollout_cpus: str | None) -> None:
    """--rollout-cpus: the rollout process (forked after this) and the tool/reward processes it starts
    go to these CPUs (envs.confine.pin_to_rollout_cpus reads ROLLOUT_CPUS_ENV), the trainer and its
    threads to the rest, so rollouts do not slow the trainer's steps. OSError where this process may not
    run there at all (a container's cpuset)."""
    if rollout_cpus is None:
        return
    cpus, allowed = parse_cpus(rollout_cpus), os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # may it run there at all?
    os.sched_setaffinity(0, allowed - cpus or allowed)
    os.environ[ROLLOUT_CPUS_ENV] = rollout_cpus


def _child_main(builds, parent_pid: int, groups, reports, shared, stop_timeout_s: float) -> None:
    version, expected, discarded, go, stopping = shared
    if not die_with_parent(parent_pid):
        return
    pin_to_rollout_cpus()  # the whole process, and everything it starts
    # Ctrl-C and SIGTERM reach the whole process group; the trainer stops us between steps (stop()).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:  # the build comes once the trainer's servers are up; a start-up that fails stops us
        try:
            build = builds.get(timeout=0.5)
            break
        except queue.Empty:
            if stopping.value:
                return
    worker = build(expected_version=lambda: expected.value)
    while not go.value:
        time.sleep(0.02)
    if stopping.value:
        return
    worker.start()
    sent, applied_discards, last, t_report = 0, 0, None, 0.0
    while not stopping.value and worker.alive:
        worker.set_version(version.value)
        # Read once: the trainer may add to it while the worker takes these (read again after, those
        # would count as applied and never reach admission).
        if (discarded_now := discarded.value) > applied_discards:
            worker.discard(discarded_now - applied_discards)
            applied_discards = discarded_now
        exhausted = worker.exhausted  # before draining: every group it counts delivered is queued by now
        try:
            # The timeout bounds how late a version bump reaches admission (a bench step: 0.4-0.5 s).
            while True:
                groups.put(worker.queue.get(timeout=0.005))
                sent += 1
        except queue.Empty:
            pass
        if time.monotonic() - t_report >= REPORT_EVERY_S:  # not every pass: a report is a copy
            report, t_report = _report(worker, exhausted, sent), time.monotonic()
            if report != last:
                reports.put(report)
                last = report
    worker.stop(timeout_s=stop_timeout_s)
    reports.put(_report(worker, worker.exhausted, sent))
    # Every group and the last report reach the trainer whole (it reads both while it waits for us;
    # if it stops reading, it kills us, and if it dies, so do we): a message cut by our exit would be
    # lost, and the trainer would meet the end of the pipe in the middle of it.
    groups.close()
    reports.close()
    groups.join_thread()
    reports.join_thread()
    # Out as a forked multiprocessing child goes out: without the interpreter's exit, whose full
    # collection over every object torch and transformers made takes ~1 s on 2 cores (stop() waits).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(worker, exhausted: bool, sent: int) -> Report:
    # A copy: the queue pickles it later, in its feeder thread, while the counters move on.
    return copy.deepcopy(Report(worker.stats, worker.client.stats, set(worker.client.down), exhausted, sent))


def build_worker(
    args: argparse.Namespace, ckpt: Path | None, urls: list[str], model_name: str, rows: list[dict],
    position: int, pending: list[int], version: int, env_module: str, *, expected_version,
) -> AsyncRolloutWorker:  # fmt: skip
    """The trainer's rollout worker, built inside the rollout process (`RolloutProcess.build` takes this
    with every argument but `expected_version` bound) from the trainer's flags: the same tokenizer and
    chat template, the env's episodes with a sandbox of their own, the row stream: the
    `pending` rows of a resume, then on from `position`. `env_module` by path: an env registered at run
    time (bench/heavy_tail_env.py) is not in a fresh process's ENVS."""
    verify.DEADLINE_S = args.reward_timeout
    make_episode = episodes_of(importlib.import_module(env_module), args.sandbox_workers)
    _, template = load_tokenizer(args, ckpt, make_episode(rows[0]))
    client = VLLMClient(
        urls, model_name, request_timeout_s=args.batch_timeout, expected_version=expected_version
    )
    worker = AsyncRolloutWorker(
        client, template, make_episode, row_stream(rows, args.seed, position, pending),
        num_generations=args.num_generations, groups_per_version=args.prompts_per_step * args.sync_every,
        max_staleness=args.max_staleness, max_turns=args.max_turns, max_context=args.max_context,
        max_calls_per_turn=args.max_calls_per_turn, sampling=sampling_of(args).request_fields(),
        seed=args.seed, max_concurrent_tools=args.sandbox_workers, scale_rewards=not args.no_scale_rewards,
        start_version=version,
    )  # fmt: skip
    if getattr(args, "lora_rank", 0):  # each request names the adapter of the version current when it is sent
        client.model = lambda: adapter_name(worker.version)
    return worker
