"""The multi-GPU rank protocol on the CPU: where launched servers land under CUDA_VISIBLE_DEVICES (device
count mocked, the launch recorded instead of run), resume under FSDP on 2 gloo ranks (memory of the rank
that does not read the file), and the other ranks' wait for rank 0's next message."""

from types import SimpleNamespace

import pytest
import torch

import vllm_server
from distributed import plan_devices


@pytest.fixture
def recorded_launches(monkeypatch):
    """A mocked GPU box whose server launches are recorded (the CUDA_VISIBLE_DEVICES each server gets,
    the start-up timeout each is waited for), never run."""
    launched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        vllm_server.VLLMServer, "_launch", lambda s: launched.append(s.env["CUDA_VISIBLE_DEVICES"])
    )
    monkeypatch.setattr(
        vllm_server.VLLMServer, "wait_healthy", lambda s, timeout_s: launched.append(timeout_s)
    )
    monkeypatch.setattr(vllm_server.VLLMServer, "stop", lambda s: None)
    return launched


@pytest.mark.parametrize(
    "visible, ranks, tp, servers_on, ranks_on",
    [
        ("4,5,6,7", 2, 1, ["4", "5"], ["6", "7"]),  # the case: servers were put on GPUs 0 and 1
        ("3,1,0,2", 1, 1, ["3", "1", "0"], ["2"]),  # reordered: a server and a rank could share a GPU
        ("7,6,5,4", 2, 2, ["7,6"], ["5", "4"]),  # tensor parallel
        ("GPU-aa,GPU-bb", 1, 1, ["GPU-aa"], ["GPU-bb"]),  # UUIDs
    ],
)
def test_launched_servers_land_on_the_gpus_the_plan_gives_them(
    monkeypatch, recorded_launches, tmp_path, visible, ranks, tp, servers_on, ranks_on
):
    """The plan numbers GPUs as the trainer sees them (positions in its CUDA_VISIBLE_DEVICES, as torch
    does for the ranks); each server is told the parent's own entries, so servers and ranks never meet."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    entries = visible.split(",")
    servers, rank_devices = plan_devices(len(entries), ranks, None, tp, launch_servers=True)
    assert [entries[int(d.removeprefix("cuda:"))] for d in rank_devices] == ranks_on
    vllm_server.start_vllm_servers(
        "m", num_servers=len(servers), gpus_per_server=tp, log_dir=tmp_path, timeout_s=7.0
    )
    assert [x for x in recorded_launches if isinstance(x, str)] == servers_on
    used = [g for group in servers_on for g in group.split(",")]
    assert not set(used) & set(ranks_on)


@pytest.mark.parametrize(
    "compute_dtype, on_gpu, bf16_bound", [("fp32", True, True), ("bf16", True, True), ("fp32", False, False)]
)
def test_the_start_up_probe_uses_the_bf16_bound_when_either_side_is_bf16(
    monkeypatch, tmp_path, compute_dtype, on_gpu, bf16_bound
):
    """`--compute-dtype fp32` on GPU: the launched servers serve bf16, so the probe must allow bf16's
    gap (it held the fp32 trainer to the fp32 bound and refused every such run). On CPU both sides are
    fp32: the tight bound. start_rollouts on a mocked box, servers and sync recorded, not run."""
    import train_async_grpo as T
    import weight_sync

    probed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
    monkeypatch.setattr(
        vllm_server, "start_vllm_servers", lambda *a, **k: [SimpleNamespace(url="http://s:1")]
    )
    monkeypatch.setattr(T, "write_servers_file", lambda *a: None)
    monkeypatch.setattr(weight_sync, "WeightSyncer", lambda *a, **k: SimpleNamespace(init=lambda: None))
    monkeypatch.setattr(T, "sync_weights", lambda *a, **k: {})
    monkeypatch.setattr(T, "probe_fidelity", lambda *a: probed.append(a[6]) or {})
    monkeypatch.setattr(T, "RolloutProcess", lambda *a: None)
    monkeypatch.setattr(T.signal, "signal", lambda *a: None)
    args = T.parser.parse_args(["--model", "m", "--compute-dtype", compute_dtype])
    run = SimpleNamespace(
        args=args, out_dir=tmp_path, servers=[], model=None, version=0, world_size=1, position=0
    )
    template = SimpleNamespace(prompt_ids=lambda messages: [1, 2])
    T.start_rollouts(run, ["0"], template, lambda row: SimpleNamespace(messages=[]), [{}], "cpu", None)
    assert probed == [bf16_bound]
