"""Shared fixtures: one real vLLM server per test session, on the warm tiny model that `make tiny-model`
builds (it calls tools, so multi-turn tests have real tool calls). Tests that change a server's weights
start their own."""

import os
from pathlib import Path

import pytest

from vllm_server import group_pids, start_vllm_server

REPO = Path(__file__).resolve().parent.parent


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
    """The model the shared server serves: fine-tuned to emit hermes tool calls."""
    return model_dir("tiny-warm")


@pytest.fixture(scope="session")
def vllm_server(served_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    timeout_s = float(os.environ.get("VLLM_START_TIMEOUT", 600))
    server = start_vllm_server(str(served_model), log_dir=log_dir, timeout_s=timeout_s)
    yield server
    server.stop()
    assert group_pids(server.proc.pid) == [], "processes of the session's vLLM server outlived stop()"
