"""Trainer-side checks for a GPU box, with no vLLM (`make gpu-check`): the parts of the GPU path the CPU
tests cannot see, on the trainer's own functions (train_step, token_logprobs, shard_model).

    python scripts/gpu_check.py                        # on cuda:0, a ~0.3B Qwen2-shaped model
    python scripts/gpu_check.py --device cpu --small   # the same checks on the CPU (tests/test_gpu_check.py)

Each check prints one line, PASS or FAIL with its numbers; the exit code is 1 if any failed.
  1. bf16 compute over fp32 masters: one AdamW step at lr 1e-6 moves the weights (bf16 weights would
     not), weights and AdamW state stay fp32, the matmuls ran in bf16.
  2. packed vs one-sequence-at-a-time logprobs on sdpa (fp32 and bf16 compute), and on flash-attention 2
     when `flash_attn` is importable.
  3. gradient checkpointing with packing: the same gradient as without.
  4. FSDP2 with the MixedPrecisionPolicy on one rank (nccl on GPU, gloo on CPU): bf16 gathered weights,
     fp32 shards, the update of the unsharded model.
  5. top-k/top-p truncation in bf16: a train step on completions whose every token sits at the nucleus
     edge (the least likely token fp32 keeps), where bf16 rounding can move it out of the kept set: no
     trained token may get −inf, the loss and every gradient stay finite.
  6. FSDP2 over 2 ranks (nccl) when 2 GPUs are visible: the update of the one-process step; skipped,
     saying so, with one (on CPU: 2 gloo ranks).
  7. throughput: packed tokens/s and peak memory of train_step with gradient checkpointing.
The model is built from a Qwen2 config with random weights (nothing from the hub). Needs torch,
transformers and aiohttp (train_async_grpo imports rollout.py); never vLLM.
"""

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
try:
    import train_async_grpo as T
    from batches import collate
    from distributed import shard_model
    from sampling import Sampling, keep_threshold, token_logprobs
except ImportError as e:
    sys.exit(f"gpu_check: cannot import the trainer ({e}); `pip install aiohttp` if that is what is missing")

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to run the checks")
p.add_argument("--small", action="store_true", help="a 2-layer model and short sequences (CPU smoke)")
p.add_argument("--steps", type=int, default=3, help="timed train steps for the throughput line")

RESULTS: list[bool] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def build_model(config: Qwen2Config, device: torch.device, attn: str = "sdpa"):
    torch.manual_seed(0)  # the same random weights every call
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    return model.to(device)


def make_seqs(n: int, prompt_len: int, completion_len: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for k in range(n):
        lp = prompt_len + k % 5
        lc = completion_len + (7 * k) % 11
        seqs.append({
            "ids": torch.randint(0, vocab, (lp + lc,), generator=gen).tolist(),
            "mask": [0] * lp + [1] * lc,
            "behaviour": [0.0] * lp + [-float(torch.rand(1, generator=gen)) - 5.0 for _ in range(lc)],
            "advantage": float(torch.randn(1, generator=gen)),
        })  # fmt: skip
    return seqs


def step_args(compute_dtype: str, micro_batch_tokens: int):
    # The trainer's own defaults (so a flag added later is present here too), then this check's settings.
    args = T.parser.parse_args(["--model", "unused"])
    args.compute_dtype, args.micro_batch_tokens = compute_dtype, micro_batch_tokens
    return args


def one_step(model, seqs, args, device, optimizer=None) -> dict:
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return T.train_step(model, None, optimizer, scheduler, seqs, args, 0, 1, device)


def check_fp32_masters(config, device, seqs, budget) -> None:
    model = build_model(config, device)
    before = [q.detach().clone() for q in model.parameters()]
    out_dtypes = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: out_dtypes.add(out.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    one_step(model, seqs, step_args("bf16", budget), device, optimizer)
    moved = touched = 0
    for q, b in zip(model.parameters(), before):
        has_grad = q.grad != 0
        moved += int(((q.detach() != b) & has_grad).sum())
        touched += int(has_grad.sum())
    fp32 = all(q.dtype == torch.float32 for q in model.parameters())
    state_fp32 = all(
        s.dtype == torch.float32 for st in optimizer.state.values() for s in st.values() if s.ndim
    )
    frac = moved / max(touched, 1)
    report(
        "bf16 compute, fp32 masters",
        frac > 0.99 and fp32 and state_fp32 and out_dtypes == {torch.bfloat16},
        f"{100 * frac:.1f}% of weights with a gradient moved at lr 1e-6; weights fp32 {fp32}, "
        f"AdamW state fp32 {state_fp32}, matmul outputs {sorted(str(d) for d in out_dtypes)}",
    )


def packed_vs_alone(model, seqs, device, compute_dtype: str) -> tuple[float, float]:
    mb = collate(seqs, device)
    bf16, sampling = compute_dtype == "bf16", Sampling(1.0)
    with torch.no_grad():
        packed, _ = token_logprobs(model, mb["input_ids"], mb["position_ids"], sampling, bf16=bf16)
        alone = []
        for s in seqs:
            ids = torch.tensor(s["ids"], device=device)[None]
            positions = torch.arange(ids.shape[1], device=device)[None]
            alone.append(token_logprobs(model, ids, positions, sampling, bf16=bf16)[0])
    mask = mb["loss_mask"].bool()
    diff = (packed[mask] - torch.cat(alone)[mask]).abs()
    return diff.max().item(), diff.mean().item()


def check_packing(config, device, seqs) -> None:
    seqs = seqs[:6]
    impls = ["sdpa"]
    try:
        import flash_attn  # noqa: F401

        impls.append("flash_attention_2")
    except ImportError:
        print("skip  flash-attention 2: flash_attn is not importable", flush=True)
    for impl in impls:
        for compute, tol in (("fp32", 1e-3), ("bf16", 0.1)):
            if impl == "flash_attention_2" and compute == "fp32":
                continue  # flash-attention has no fp32 kernels
            try:
                model = build_model(config, device, impl).eval()
                worst, mean = packed_vs_alone(model, seqs, device, compute)
            except Exception as e:  # noqa: BLE001 - reported as this check's failure
                report(f"packed logprobs, {impl}, {compute}", False, f"{type(e).__name__}: {e}")
                continue
            report(
                f"packed logprobs, {impl}, {compute}",
                worst < tol,
                f"packed vs one at a time: max |Δ| {worst:.2e}, mean {mean:.2e} nats (tolerance {tol})",
            )


def grads(model, seqs, args, device) -> torch.Tensor:
    one_step(model, seqs, args, device, torch.optim.SGD(model.parameters(), lr=0.0))
    return torch.cat([q.grad.flatten().float() for q in model.parameters()])


def check_gradient_checkpointing(config, device, seqs, budget) -> None:
    args = step_args("bf16", budget)
    plain = grads(build_model(config, device), seqs, args, device)
    model = build_model(config, device)
    model.gradient_checkpointing_enable()
    ckpt = grads(model, seqs, args, device)
    rel = ((ckpt - plain).norm() / plain.norm()).item()
    report("gradient checkpointing with packing", rel < 1e-2, f"gradient relative difference {rel:.2e}")


def check_fsdp(config, device, seqs, budget) -> None:
    from vllm_server import free_port  # imports torch only at module level

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        args = step_args("bf16", budget)
        reference = build_model(config, device)
        start = [q.detach().clone() for q in reference.parameters()]
        one_step(reference, seqs, args, device, torch.optim.SGD(reference.parameters(), lr=0.5))
        model = build_model(config, device)
        shard_model(model, "bf16")
        seen = []
        model.model.layers[0].mlp.down_proj.register_forward_pre_hook(
            lambda m, _: seen.append(m.weight.dtype)
        )
        one_step(model, seqs, args, device, torch.optim.SGD(model.parameters(), lr=0.5))
        full = [q.full_tensor() for q in model.parameters()]
        shards_fp32 = all(q.dtype == torch.float32 for q in model.parameters())
        u = torch.cat([(r.detach() - s).flatten() for r, s in zip(reference.parameters(), start)])
        v = torch.cat([(f.detach() - s).flatten() for f, s in zip(full, start)])
        rel = ((u - v).norm() / u.norm()).item()
        report(
            f"FSDP2 + MixedPrecisionPolicy, 1 rank over {backend}",
            seen[:1] == [torch.bfloat16] and shards_fp32 and rel < 0.05,
            f"gathered weights {seen[0] if seen else None}, shards fp32 {shards_fp32}, update vs unsharded "
            f"autocast: relative difference {rel:.2e}",
        )
    finally:
        dist.destroy_process_group()


EDGE_TOKENS = 24  # completion tokens per sequence of check 5 (one forward each, to find its edge token)


def shorten(seq: dict, completion_tokens: int) -> dict:
    """`seq` with its whole prompt and its first `completion_tokens` completion tokens: every per-token
    field cut alike (a cut inside the prompt would leave no completion, one of `ids` alone a ragged row)."""
    end = seq["mask"].index(1) + completion_tokens
    return {**seq, "ids": seq["ids"][:end], "mask": seq["mask"][:end], "behaviour": seq["behaviour"][:end]}


@torch.no_grad()
def nucleus_edge(model, seqs: list[dict], sampling: Sampling, device) -> list[dict]:
    """`seqs` with each completion token replaced, left to right, by the least likely token the fp32
    model keeps under `sampling`: the token a server samples that bf16 rounding most easily drops."""
    out = []
    for s in seqs:
        ids, start = list(s["ids"]), s["mask"].index(1)
        for j in range(start, len(ids)):
            logits = model(input_ids=torch.tensor([ids[:j]], device=device)).logits[0, -1].float()
            scaled = logits / sampling.temperature
            kept = scaled >= keep_threshold(scaled[None], sampling)[0]
            ids[j] = int(torch.where(kept, scaled, torch.inf).argmin())
        out.append({**s, "ids": ids})
    return out


def check_truncation(config, device, seqs, budget) -> None:
    args = step_args("bf16", budget)
    args.top_k, args.top_p, args.temperature = 50, 0.9, 1.0
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    model = build_model(config, device)
    edge = nucleus_edge(model.eval(), [shorten(q, EDGE_TOKENS) for q in seqs[:4]], sampling, device)
    mb = collate(edge, device)
    with torch.no_grad():
        lp, _ = token_logprobs(model, mb["input_ids"], mb["position_ids"], sampling, bf16=True)
    trained = lp[mb["loss_mask"].bool()]
    dropped = int((~trained.isfinite()).sum())
    metrics = one_step(model.train(), edge, args, device)
    finite = all(q.grad is None or q.grad.isfinite().all() for q in model.parameters())
    finite = finite and all(q.isfinite().all() for q in model.parameters())
    ok = dropped == 0 and finite and torch.isfinite(torch.tensor(metrics["train/loss"]))
    report(
        "top-k 50 / top-p 0.9 in bf16",
        bool(ok),
        f"{dropped} of {trained.numel()} nucleus-edge tokens got −inf; loss {metrics['train/loss']:.4g}, "
        f"gradients and weights finite {finite}",
    )


def _fsdp_two_ranks(rank: int, port: int, config, device_type: str, seqs, budget, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))  # fmt: skip
    from distributed import init_distributed  # nccl on GPU (rank r on cuda:r), gloo on CPU

    torch.set_num_threads(1) if device_type == "cpu" else None
    _, _, device = init_distributed(0, 600)
    try:
        args = step_args("bf16", budget)
        model = build_model(config, device)
        shard_model(model, "bf16")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        T.train_step(model, None, optimizer, scheduler, seqs, args, rank, 2, device)
        full = [q.full_tensor().detach().cpu() for q in model.parameters()]
        if rank == 0:
            torch.save(full, out)
        dist.barrier()  # leave together (test_distributed's resume test says why)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # done, its result on disk: no interpreter teardown (test_distributed's resume test)


def check_fsdp_two_ranks(config, device, seqs, budget) -> None:
    name = "FSDP2 over 2 ranks"
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        print(f"skip  {name}: {torch.cuda.device_count()} GPU visible, it needs 2", flush=True)
        return
    import tempfile

    import torch.multiprocessing as mp

    from vllm_server import free_port

    args = step_args("bf16", budget)
    reference = build_model(config, device)
    start = [q.detach().cpu().clone() for q in reference.parameters()]
    one_step(reference, seqs, args, device, torch.optim.SGD(reference.parameters(), lr=0.5))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "weights.pt"
        spawn_args = (free_port(), config, device.type, seqs, budget, out)
        mp.spawn(_fsdp_two_ranks, args=spawn_args, nprocs=2, join=True)
        full = torch.load(out)
    u = torch.cat([(r.detach().cpu() - s).flatten() for r, s in zip(reference.parameters(), start)])
    v = torch.cat([(f - s).flatten() for f, s in zip(full, start)])
    rel = ((u - v).norm() / u.norm()).item()
    backend = "nccl" if device.type == "cuda" else "gloo"
    report(f"{name} ({backend})", rel < 0.05, f"update vs one process: relative difference {rel:.2e}")


def check_throughput(config, device, seqs, budget, steps: int) -> None:
    model = build_model(config, device)
    model.gradient_checkpointing_enable()  # as the trainer on GPU
    args = step_args("bf16", budget)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    one_step(model, seqs, args, device, optimizer)  # warm-up: kernels, allocator, AdamW state
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step(model, seqs, args, device, optimizer)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    else:
        peak = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    seconds = time.perf_counter() - t0
    tokens = steps * sum(len(s["ids"]) for s in seqs)
    params = sum(q.numel() for q in model.parameters()) / 1e6
    report(
        "throughput",
        True,
        f"{params:.0f}M params, {tokens / seconds:,.0f} train tokens/s (bf16 compute, gradient "
        f"checkpointing, micro-batches of {budget} tokens, {steps} steps), {peak}",
    )


def main() -> None:
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; `--device cpu --small` runs the same checks on the CPU")
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}", flush=True)
    if args.small:
        config = Qwen2Config(
            vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        )  # fmt: skip
        seqs, budget = make_seqs(12, 8, 16, 512), 128
    else:  # Qwen2.5-0.5B's shape with a smaller vocabulary
        config = Qwen2Config(
            vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192,
        )  # fmt: skip
        seqs, budget = make_seqs(64, 200, 300, 32000), 4096
    check_fp32_masters(config, device, seqs, budget)
    check_packing(config, device, seqs)
    check_gradient_checkpointing(config, device, seqs, budget)
    check_fsdp(config, device, seqs, budget)
    check_truncation(config, device, seqs, budget)
    check_fsdp_two_ranks(config, device, seqs, budget)
    check_throughput(config, device, seqs, budget, args.steps)
    assert "vllm" not in sys.modules, "gpu_check imported vLLM"
    print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed; vLLM not imported", flush=True)
    sys.exit(0 if all(RESULTS) else 1)


if __name__ == "__main__":
    main()
