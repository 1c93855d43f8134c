"""GPU tests (`make gpu-test`; the `gpu` marker): what only a CUDA device can show. torch and transformers,
no vLLM (its producer and consumer are used where it is installed, a copy of their stream handling where
it is not). Skipped, with one reason, where no CUDA device is visible.

  - the NCCL send path (WeightSyncer._send -> _nccl_broadcast -> _feed) into a consumer that packs on
    side streams as vLLM 0.32's packed_nccl_broadcast_producer does: every byte it packs is the
    parameter cast to bf16, with the feeding thread's stream idle and busy (as behind FSDP gathers);
  - every scripts/gpu_check.py check at its GPU shapes: a broken check fails here, it does not crash;
  - with two GPUs, a real 2-rank NCCL broadcast through WeightSyncer into a receiver reading on a side
    stream.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sampling import Sampling, processed_logits
from weight_sync import DEFAULT_BUCKET_BYTES, WeightSyncer

REPO = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device visible: make gpu-test on a GPU"
    ),
]
BUSY_CYCLES = 2_000_000  # ~1 ms of a spinning kernel queued before each gather (torch.cuda._sleep)


def qwen_shapes(layers: int, hidden: int, inter: int, kv: int, vocab: int) -> list[tuple[str, list[int]]]:
    """A Qwen2 checkpoint's parameter shapes, in load order."""
    shapes = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "self_attn.q_proj.weight", [hidden, hidden]), (p + "self_attn.q_proj.bias", [hidden]),
            (p + "self_attn.k_proj.weight", [kv, hidden]), (p + "self_attn.k_proj.bias", [kv]),
            (p + "self_attn.v_proj.weight", [kv, hidden]), (p + "self_attn.v_proj.bias", [kv]),
            (p + "self_attn.o_proj.weight", [hidden, hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "mlp.gate_proj.weight", [inter, hidden]), (p + "mlp.up_proj.weight", [inter, hidden]),
            (p + "mlp.down_proj.weight", [hidden, inter]),
        ]  # fmt: skip
    return shapes + [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]


SHAPES_1_5B = qwen_shapes(28, 1536, 8960, 256, 151936)  # Qwen2.5-1.5B, untied: 1.78B parameters
SHAPES_0_5B = qwen_shapes(24, 896, 4864, 128, 151936)


def make_params(shapes, device, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device).manual_seed(seed)
    return [(n, torch.randn(s, device=device, generator=gen)) for n, s in shapes]


class Gathered:
    """Stands in for an FSDP2 DTensor: `full_tensor()` returns a new tensor queued behind other work on
    the current stream, as an all-gather's output is (busy: a ~1 ms kernel first)."""

    def __init__(self, tensor: torch.Tensor, busy: bool):
        self.tensor, self.busy, self.shape, self.dtype = tensor, busy, tensor.shape, tensor.dtype

    def full_tensor(self) -> torch.Tensor:
        if self.busy:
            torch.cuda._sleep(BUSY_CYCLES)
        return self.tensor.clone()


def packed_producer(iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers) -> None:
    """vLLM 0.32's packed_nccl_broadcast_producer (vllm/distributed/weight_transfer/packed_tensor.py):
    vLLM's own where it is installed; else its stream handling, line for line: each buffer is drawn,
    packed (torch.cat) and broadcast inside `torch.cuda.stream(side)`, a stream nothing orders after the
    feeding thread's, and only that side stream is synchronized before its buffer is reused."""
    try:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
    except ImportError:
        pass
    else:
        return packed_nccl_broadcast_producer(
            iterator=iterator, group=group, src=src, post_iter_func=post_iter_func,
            buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers,
        )  # fmt: skip
    streams = [torch.cuda.Stream() for _ in range(num_buffers)]
    in_flight = [None] * num_buffers
    i = 0
    while True:
        streams[i].synchronize()
        in_flight[i] = None
        with torch.cuda.stream(streams[i]):
            tensors, size = [], 0
            for item in iterator:
                tensors.append(post_iter_func(item).contiguous().view(-1).view(torch.uint8))
                size += tensors[-1].numel()
                if size > buffer_size_bytes:
                    break
            if not tensors:
                break
            packed = torch.cat(tensors)
            group.broadcast(packed, src=src)
            in_flight[i] = packed
            i = (i + 1) % num_buffers
    for s in streams:
        s.synchronize()


class Recorder:
    """The communicator's place: keeps a copy of each broadcast buffer, made on the broadcasting
    (current) stream, so it sees exactly the bytes a broadcast would send."""

    def __init__(self):
        self.received: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.received.append(tensor.clone())


def wrong_bytes(received: torch.Tensor, params: list[tuple[str, torch.Tensor]]) -> tuple[int, list[str]]:
    """(bytes that differ from each parameter cast to bf16, the names of the tensors with any)."""
    wrong, names, at = 0, [], 0
    for name, p in params:
        want = p.to(torch.bfloat16).view(-1).view(torch.uint8)
        got = received[at : at + want.numel()]
        at += want.numel()
        bad = int((got != want).sum()) if got.numel() == want.numel() else want.numel()
        wrong += bad
        names += [name] if bad else []
    assert at == received.numel(), f"sent {received.numel()} bytes, the parameters are {at}"
    return wrong, names


def syncer_over(group) -> WeightSyncer:
    syncer = WeightSyncer(["http://127.0.0.1:1"], backend="nccl", transfer_timeout_s=300)
    syncer.groups = {syncer.urls[0]: group}
    syncer._produce = lambda group, items: packed_producer(
        items, group, 0, lambda item: item[1], syncer.bucket_bytes, 2
    )
    return syncer


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_nccl_send_path_sends_every_byte_of_the_bf16_cast(busy):
    """The tensors `_feed` hands from the gathering thread to the sending thread are read on vLLM's side
    streams: each waits on an event recorded after its cast and is `record_stream`ed there. Without it
    (on an H100) 6 of 6 syncs with the default stream busy sent garbage (58-65 % of 1 GB wrong), and
    some with it idle. Several trials, each sync of ~1.8B parameters compared byte by byte."""
    device = torch.device("cuda", torch.cuda.current_device())
    params = make_params(SHAPES_1_5B, device, seed=0)
    for trial in range(4):
        for _, p in params:  # the optimizer step, queued on the default stream just before the sync
            p.mul_(0.999)
        recorder = Recorder()
        syncer = syncer_over(recorder)
        sent = [(n, Gathered(p, busy)) for n, p in params]
        num_bytes, errors = syncer._send(sent, [torch.bfloat16] * len(sent), syncer.urls)
        torch.cuda.synchronize()
        assert errors == {} and recorder.received
        wrong, names = wrong_bytes(torch.cat(recorder.received), params)
        assert wrong == 0, (
            f"trial {trial} ({'busy' if busy else 'idle'} default stream): {wrong} of {num_bytes} bytes "
            f"sent are not the bf16 cast, in {len(names)} tensors, first {names[:3]}"
        )
        del recorder, sent


@pytest.mark.timeout(1800)
def test_every_gpu_check_passes_at_its_gpu_shapes():
    """scripts/gpu_check.py as `make gpu-check` runs it (cuda:0, the ~0.3B model, 200-token prompts):
    every check prints PASS (the 2-rank FSDP check may skip with one GPU); a crash fails here."""
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py")], cwd=REPO, capture_output=True, text=True,
        timeout=1700,
    )  # fmt: skip
    print(r.stdout)
    lines = [x for x in r.stdout.splitlines() if x.startswith(("PASS", "FAIL", "skip"))]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not any(x.startswith("FAIL") for x in lines), r.stdout
    passed = sum(x.startswith("PASS") for x in lines)
    assert passed >= 7 and f"{passed}/{passed} checks passed; vLLM not imported" in r.stdout, r.stdout


def _nccl_rank(rank: int, port: int, out: Path) -> None:
    """Rank 0: the trainer, sending through WeightSyncer with a busy default stream. Rank 1: a server's
    worker, receiving each packed buffer on a side stream and comparing it there with the parameters
    it builds from the same seed, cast to bf16."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    class Group:  # PyNcclCommunicator's broadcast, on torch's NCCL process group
        def broadcast(self, tensor: torch.Tensor, src: int) -> None:
            dist.broadcast(tensor, src)

    params = make_params(SHAPES_0_5B, device, seed=1)
    if rank == 0:
        syncer = syncer_over(Group())
        sent = [(n, Gathered(p, busy=True)) for n, p in params]
        _, errors = syncer._send(sent, [torch.bfloat16] * len(sent), syncer.urls)
        torch.cuda.synchronize()
        result = {"errors": errors}
    else:
        # vLLM's packed consumer, on its own side stream: the same cut as the producer's (a buffer ends
        # with the tensor that takes it past the bucket size).
        side, wrong, names, bucket, size = torch.cuda.Stream(), 0, [], [], 0
        with torch.cuda.stream(side):
            for k, (name, p) in enumerate(params):
                bucket.append((name, p.to(torch.bfloat16).view(-1).view(torch.uint8)))
                size += bucket[-1][1].numel()
                if size > DEFAULT_BUCKET_BYTES or k == len(params) - 1:
                    buf = torch.empty(size, dtype=torch.uint8, device=device)
                    dist.broadcast(buf, 0)
                    got = buf.split([w.numel() for _, w in bucket])
                    for (n, want), g in zip(bucket, got):
                        bad = int((g != want).sum())
                        wrong += bad
                        names += [n] if bad else []
                    bucket, size = [], 0
        side.synchronize()
        result = {"wrong": wrong, "names": names[:5], "bytes": sum(p.numel() * 2 for _, p in params)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(600)
def test_real_nccl_broadcast_through_the_syncer_to_a_side_stream_reader(tmp_path):
    import torch.multiprocessing as mp

    from vllm_server import free_port

    mp.spawn(_nccl_rank, args=(free_port(), tmp_path), nprocs=2, join=True)
    sender = json.loads((tmp_path / "rank0.json").read_text())
    receiver = json.loads((tmp_path / "rank1.json").read_text())
    assert sender["errors"] == {}
    assert receiver["wrong"] == 0, f"{receiver['wrong']} of {receiver['bytes']} bytes wrong: {receiver}"


@pytest.mark.parametrize("sampling", [Sampling(0.8), Sampling(0.9, top_p=0.8, top_k=200)], ids=str)
def test_streamed_head_in_bf16_is_as_close_to_float64_as_the_full_logits_path(sampling, head_compiled):
    """sampling.streamed_logprobs on CUDA, bf16, at Qwen's vocabulary: its row-chunked forward and its
    backward by vocabulary slices (other matmul shapes than the forward's: the kept set comes from the
    forward's bits, not from re-rounded logits) against the (N, V) bf16 path it replaced, both measured
    against float64: logprobs and both gradients within 4x the full path's own distance. Eager, and
    compiled as --compile runs it (inductor's Triton kernels; the backward's on autograd's device
    thread)."""
    from sampling import head_logits, streamed_logprobs, token_logprobs_and_entropy

    cuda = torch.device("cuda")
    gen = torch.Generator(cuda).manual_seed(0)
    n, hidden, vocab = 1024, 256, 151_936
    h64 = torch.randn(n, hidden, device=cuda, generator=gen, dtype=torch.float64)
    w64 = torch.randn(vocab, hidden, device=cuda, generator=gen, dtype=torch.float64) * 0.15
    targets = torch.randint(0, vocab, (n,), device=cuda, generator=gen)
    targets[::3] = (h64 @ w64.T).argmax(-1)[::3]  # sampled-like tokens, in every kept set
    weights = torch.randn(n, device=cuda, generator=gen, dtype=torch.float64)

    def run(head, h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, _ = head(h, w)
        (lp * weights.to(lp.dtype)).sum().backward()
        return lp.detach().double(), h.grad.double(), w.grad.double()

    ref = run(lambda h, w: token_logprobs_and_entropy(h @ w.T, targets, sampling), h64, w64)
    full = run(
        lambda h, w: token_logprobs_and_entropy(head_logits(h, w, True), targets, sampling),
        h64.float(),
        w64.float(),
    )
    streamed = run(
        lambda h, w: streamed_logprobs(h, w, targets, sampling, bf16=True), h64.float(), w64.float()
    )
    if sampling.truncates:
        assert torch.isinf(processed_logits(h64 @ w64.T, sampling)).float().mean() > 0.5
    for name, r, f, s in zip(["logprobs", "grad hidden", "grad weight"], ref, full, streamed):
        full_err, err = (f - r).abs().max().item(), (s - r).abs().max().item()
        assert 0 < err <= 4 * full_err, (name, err, full_err)
