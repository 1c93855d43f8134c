"""Shared fixtures: one real vLLM server per test session, on the tiny model `make tiny-model` builds."""

import os
from pathlib import Path

import pytest

from vllm_server import group_pids, start_vllm_server

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "models" / "tiny"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"{TINY_MODEL} missing: run `make tiny-model` (make test does it for you)")
    return TINY_MODEL


@pytest.fixture(scope="session")
def vllm_server(tiny_model, tmp_path_factory):
    """One server for the whole session; tests that need their own start one with start_vllm_server."""
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    server = start_vllm_server(
        str(tiny_model), log_dir=log_dir, timeout_s=float(os.environ.get("VLLM_START_TIMEOUT", 600))
    )
    yield server
    server.stop()
    assert group_pids(server.proc.pid) == [], "processes of the session's vLLM server outlived stop()"
