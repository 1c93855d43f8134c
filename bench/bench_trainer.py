"""Figure 10, the trainer's step: train tokens/s, model-FLOP utilisation, peak memory, and the logprob
head's extra memory, the streamed head (sampling.streamed_logprobs) beside the full-logits head it
replaced, in one run.

    python bench/bench_trainer.py [--out bench/results.json]              # CPU form (make bench)
    python bench/bench_trainer.py --device cuda [--out bench/results.json] # GPU form (make bench-gpu)

Head memory (both forms): one forward + backward of the head alone on N tokens of Qwen's real 151,936-token
vocabulary, in a fresh subprocess each, extra = peak minus what was resident before the call (inputs,
weight and its gradient buffer allocated first). CPU: the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs); CUDA: torch.cuda.max_memory_allocated. The old head holds (N, V) fp32 tensors,
so on CPU it is measured at 1-2k tokens and extrapolated linearly to 8k and 16k (the two points show the
line); the new one is measured at 16k. The hidden size is small on CPU (the head's working set does not
depend on it; its FLOPs do) and the real one on GPU.

Train tokens/s: trainer.train_step on GRPO-shaped batches of random sequences (16-token prompts, the rest
trained) through a Qwen2-shaped model with random weights and tied embeddings, in a subprocess per
setting (so each has its own peak memory), a new batch every step (new packings, as in training): old
head / new head / new head with --compile on (trainer.compile_model; its first step's seconds, the
graphs inductor made and the recompiles after the first step, with inductor's cache empty; on CPU also
compile off and on side by side in one process, side_by_side_child); on GPU also
gradient checkpointing on / off, per-sequence sdpa / varlen attention and 8k / 16k micro-batches. MFU:
(6 N + causal attention 6 · len² · d_model per layer: QKᵀ and PV over the lower triangle, 2 · len² ·
d_model forward, × 3 with the backward) FLOPs per trained batch over the device's dense
bf16 peak (PEAK_TFLOPS by device name, or --peak-tflops); recomputation under checkpointing is not
counted (the usual convention).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters, guard_failures
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
import sampling  # noqa: E402
import train_async_grpo as script  # noqa: E402
import trainer  # noqa: E402
from bench.bench_packing import random_sequences  # noqa: E402
from bench.results import merge_results  # noqa: E402
from sampling import Sampling, streamed_logprobs, token_logprobs_and_entropy  # noqa: E402

VOCAB = 151_936  # Qwen2 / Qwen2.5
# Qwen2.5 shapes (config.json of each): hidden, MLP width, layers, query heads, KV heads
PRESETS = {
    "0.5B": (896, 4864, 24, 14, 2),
    "1.5B": (1536, 8960, 28, 12, 2),
    "3B": (2048, 11008, 36, 16, 2),
    "cpu-small": (128, 512, 2, 4, 2),
}
PEAK_TFLOPS = {
    "H200 NVL": 835,
    "H200": 989,
    "H100 NVL": 835,
    "H100 PCIe": 756,
    "H100": 989,
    "B200": 2250,
    "A100": 312,
    "L40S": 362,
    "L4": 121,
}


def peak_tflops(name: str) -> float | None:
    """Dense bf16 peak of a device, by the first (longest) entry its name contains."""
    return next((v for k, v in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


# ---------------------------------------------------------------------------------------------------
# HEAD MEMORY: one head forward + backward in a fresh process
# ---------------------------------------------------------------------------------------------------
def old_head(hidden, weight, targets, sampling, bf16):
    """The head before issue 38: the (N, V) logits, then the processing on all of them."""
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = hidden @ weight.T
    return token_logprobs_and_entropy(logits, targets, sampling, with_entropy=True)


def new_head(hidden, weight, targets, sampling, bf16):
    return streamed_logprobs(hidden, weight, targets, sampling, with_entropy=True, bf16=bf16)


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmHWM:"))


def head_memory_child(head: str, tokens: int, hidden_size: int, device: str) -> dict:
    device = torch.device(device)
    bf16 = device.type == "cuda"
    torch.manual_seed(0)
    # made in place (no temporaries that would set the peak before the call)
    hidden = torch.empty(tokens, hidden_size, device=device).normal_().requires_grad_()
    weight = torch.empty(VOCAB, hidden_size, device=device).normal_(std=0.02).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), device=device)
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)  # the step holds these
    fn = old_head if head == "old" else new_head
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resident_bytes()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    lp, _ = fn(hidden, weight, targets, Sampling(0.8), bf16)
    lp.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_resident_bytes()
    return {"extra_gib": round((peak - before) / 2**30, 3), "seconds": round(time.perf_counter() - t0, 2)}


def child(cmd: list[str], env: dict | None = None, timeout_s: float = 600) -> dict:
    """One measurement in a fresh process: its last stdout line (JSON), or {"error": ...} with the end of
    its stderr printed (e.g. out of memory: a figure, not a crash of the bench; a hang: its timeout)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {timeout_s:.0f} s"}
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    tail = done.stderr.strip().splitlines()[-15:] or ["?"]
    print("\n".join("  | " + line for line in tail), flush=True)
    return {"error": tail[-1][:200]}


def head_memory(head: str, tokens: int, hidden_size: int, device: str) -> dict:
    cmd = [sys.executable, __file__, "--child-head", head, "--tokens", str(tokens),
           "--hidden", str(hidden_size), "--device", device]  # fmt: skip
    result = child(cmd)
    print(f"head {head} at {tokens} tokens: {result}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------
# TRAIN STEP: tokens/s, MFU and peak memory of one setting in a fresh process
# ---------------------------------------------------------------------------------------------------
def qwen2_model(preset: str, device: torch.device, attention: str):
    hidden, mlp, layers, heads, kv = PRESETS[preset]
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
        max_position_embeddings=32768,
    )  # fmt: skip
    config._attn_implementation = attention
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def old_score(model, mb, sampling, bf16, with_entropy=False):
    """trainer.score before issue 38: the model's (T, V) logits of every position, then the processing."""
    with torch.autocast(mb["input_ids"].device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits[0]
    lp, ent = token_logprobs_and_entropy(logits[:-1], mb["input_ids"][0, 1:], sampling, with_entropy)
    zero = lp.new_zeros(1)
    return torch.cat([zero, lp]), (torch.cat([zero, ent]) if with_entropy else None)


def step_flops(config, seqs: list[dict]) -> float:
    """6 N per token (N counts the tied embedding once, as the LM head) + causal attention's
    QKᵀ and PV: 2 · 2 · len² / 2 · d_model per layer forward, × 3 with the backward."""
    c = config
    kv = c.hidden_size // c.num_attention_heads * c.num_key_value_heads
    per_layer = c.hidden_size * (2 * c.hidden_size + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    n = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    tokens = sum(len(s["ids"]) for s in seqs)
    attention = sum(2 * len(s["ids"]) ** 2 * c.hidden_size for s in seqs) * c.num_hidden_layers
    return 6 * n * tokens + 3 * attention


def side_by_side_child(setting: dict) -> dict:
    """--compile off and on in one process: two copies of the model, steps alternating on the same new
    batches (which goes first alternates too), so the load of a shared machine slows both alike. The
    figure is the median over the pairs of eager seconds / compiled seconds (> 1: compile pays)."""
    device = torch.device(setting["device"])
    attn = trainer.packed_attention(device, "fp32")
    args = script.parser.parse_args(["--model", "m", "--micro-batch-tokens", str(setting["micro_batch"])])
    args.compute_dtype = "fp32"
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = qwen2_model(setting["preset"], device, attn)
        if compiled:
            trainer.compile_model("on", device, model)
        runs.append((model, *script.make_optimizer(model, args)))
    n, lo, hi = setting["sequences"], setting["min_len"], setting["max_len"]
    seconds: list[list[float]] = [[], []]
    for rep in range(setting["repeats"] + 1):  # the first pair warms up (and compiles)
        seqs = random_sequences(n, lo, hi, VOCAB, seed=rep)
        for which in (0, 1) if rep % 2 else (1, 0):
            sampling.compile_head(bool(which))  # the head's switch is the process's: set per step
            t0 = time.perf_counter()
            model, optimizer, scheduler = runs[which]
            trainer.train_step(model, None, optimizer, scheduler, seqs, args, 0, 1, device)
            seconds[which].append(time.perf_counter() - t0)
    ratios = [e / c for e, c in zip(seconds[0][1:], seconds[1][1:])]
    return {"speedup": round(statistics.median(ratios), 3), "pairs": [round(r, 3) for r in ratios],
            "compile_s": round(seconds[1][0] - seconds[0][0], 1)}  # fmt: skip


def step_child(setting: dict) -> dict:
    device = torch.device(setting["device"])
    if setting.get("compile") == "side_by_side":
        return side_by_side_child(setting)
    torch.manual_seed(0)
    bf16 = device.type == "cuda"
    attn = trainer.packed_attention(device, "bf16" if bf16 else "fp32")
    if not setting["varlen"]:
        attn = trainer.packed_attention(torch.device("cpu"), "fp32")  # per-sequence sdpa
    model = qwen2_model(setting["preset"], device, attn)
    if setting["checkpointing"]:
        model.gradient_checkpointing_enable()
    if setting.get("compile"):
        trainer.compile_model("on", device, model)
    args = script.parser.parse_args(["--model", "m", "--micro-batch-tokens", str(setting["micro_batch"])])
    args.compute_dtype = "bf16" if bf16 else "fp32"
    optimizer, scheduler = script.make_optimizer(model, args)
    if setting["head"] == "old":
        trainer.score = old_score
    # a new batch every step (same lengths' distribution): new packings, as in training, so a compiled
    # model that recompiled for each would show it here
    n, lo, hi = setting["sequences"], setting["min_len"], setting["max_len"]
    batches = [random_sequences(n, lo, hi, VOCAB, seed=rep) for rep in range(setting["repeats"] + 1)]
    seconds, graphs = [], []
    for rep, seqs in enumerate(batches):  # the first warms up (and compiles, with "compile")
        if rep == 1 and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif rep == 1:
            Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        trainer.train_step(model, None, optimizer, scheduler, seqs, args, 0, 1, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        graphs.append((counters["stats"]["unique_graphs"], sum(len(r) for r in guard_failures.values())))
    timed = list(zip(batches, seconds))[1:]
    tok_s = statistics.median(sum(len(s["ids"]) for s in seqs) / t for seqs, t in timed)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_resident_bytes()
    out = {"tok_s": round(tok_s, 1), "peak_gib": round(peak / 2**30, 2), "attention": attn,
           "first_step_s": round(seconds[0], 2)}  # fmt: skip
    if setting.get("compile"):  # graphs and recompiles of the first step, and of the later ones
        (g0, r0), (g, r) = graphs[0], graphs[-1]
        out.update(graphs=g0, recompiles=r0, later_graphs=g - g0, later_recompiles=r - r0)
    if device.type == "cuda":
        tflops = setting["peak_tflops"] or peak_tflops(torch.cuda.get_device_name())
        if tflops:
            mfu = statistics.median(step_flops(model.config, seqs) / t / (tflops * 1e12) for seqs, t in timed)
            out["mfu"] = round(mfu, 4)
    if setting.get("profile"):
        again = batches[0]  # a packing the warm-up compiled for
        out["profile"] = profile_step(
            lambda: trainer.train_step(model, None, optimizer, scheduler, again, args, 0, 1, device), device
        )
    return out


def profile_step(run, device: torch.device) -> dict:
    """One more step under torch.profiler: the share of its wall time the device was busy (kernels summed:
    the launches and host syncs show as the rest), the kernel count, and the kernels taking most time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    kernels = [
        e
        for e in prof.events()
        if (e.device_type.name == "CUDA") == cuda and not getattr(e, "is_user_annotation", False)
    ]
    if not cuda:  # CPU: the aten ops at the top of their stacks
        kernels = [e for e in kernels if e.cpu_parent is None]
    timed = [(e.name, e.device_time if cuda else e.cpu_time) for e in kernels]
    totals: dict = {}
    for name, us in timed:
        total, n = totals.get(name, (0.0, 0))
        totals[name] = (total + us, n + 1)
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:15]
    busy_us = sum(us for _, us in timed)
    return {"busy": round(busy_us / wall_us, 3), "kernels": len(kernels), "wall_s": round(wall_us / 1e6, 2),
            "top_ms": [[name[:90], round(us / 1e3, 1), n] for name, (us, n) in top]}  # fmt: skip


def step(setting: dict) -> dict:
    cmd = [sys.executable, __file__, "--child-step", json.dumps(setting), "--device", setting["device"]]
    with tempfile.TemporaryDirectory() as cache:  # inductor's cache empty: the compile a first run waits for
        result = child(cmd, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    print(f"step {setting}: {result}", flush=True)
    return result


# The GPU form's train-step settings over its base (new head, no checkpointing, 8k micro-batches, varlen),
# the goals first (a lease may end before the last).
GPU_STEPS = {
    "new_head_ckpt_on_16k": {"checkpointing": True, "micro_batch": 16384},
    "new_head": {},
    "old_head_ckpt_on": {"head": "old", "checkpointing": True},  # the trainer before issue 38
    "new_head_compile_on": {"compile": True},  # beside new_head: compile off
    "new_head_ckpt_on_16k_compile_on": {"checkpointing": True, "micro_batch": 16384, "compile": True},
    "new_head_per_sequence_sdpa": {"varlen": False},
    "new_head_ckpt_on": {"checkpointing": True},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cpu (the small form) or cuda (the presets)"
    )
    p.add_argument(
        "--presets",
        nargs="+",
        default=["0.5B", "1.5B", "3B"],
        choices=list(PRESETS),
        help="GPU form's model shapes",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak (TFLOP/s)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per setting (median), after a warm-up")
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    p.add_argument("--only", nargs="+", choices=GPU_STEPS, metavar="SETTING",
                   help=f"GPU form: these train-step settings only, of {', '.join(GPU_STEPS)}")  # fmt: skip
    p.add_argument(
        "--profile", action="store_true", help="one more step of each setting under torch.profiler"
    )
    p.add_argument("--child-head", choices=["old", "new"], help=argparse.SUPPRESS)
    p.add_argument("--child-step", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=16384, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=64, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # one core, like bench_packing: the machine may be shared
    if args.child_head:
        print(json.dumps(head_memory_child(args.child_head, args.tokens, args.hidden, args.device)))
        return
    if args.child_step:
        print(json.dumps(step_child(json.loads(args.child_step))))
        return

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        p.error(
            f"--device cuda: torch {torch.__version__} sees no CUDA device here; "
            "the CPU form is `python bench/bench_trainer.py` (make bench)"
        )
    result: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu (1 thread)"}
    # the head alone
    hidden = 1536 if gpu else 64
    old = {n: head_memory("old", n, hidden, args.device) for n in ([8192, 16384] if gpu else [1024, 2048])}
    new = {n: head_memory("new", n, hidden, args.device) for n in [2048, 16384]}
    if not gpu:  # linear in N: extrapolate the old head's line to 8k and 16k
        (n1, a), (n2, b) = old.items()
        slope = (b["extra_gib"] - a["extra_gib"]) / (n2 - n1)
        for n in (8192, 16384):
            old[n] = {"extra_gib": round(a["extra_gib"] + slope * (n - n1), 2), "extrapolated": True}
    result["head_extra_gib"] = {
        "hidden": hidden, "vocab": VOCAB, "old": {str(k): v for k, v in old.items()},
        "new": {str(k): v for k, v in new.items()},
    }  # fmt: skip
    # train steps
    base = {"device": args.device, "repeats": args.repeats, "peak_tflops": args.peak_tflops, "varlen": gpu,
            "checkpointing": False, "head": "new", "compile": False, "profile": args.profile}  # fmt: skip
    if gpu:
        batch = {"sequences": 64, "min_len": 300, "max_len": 2300}
        runs = {}
        for preset in args.presets:
            s = {**base, **batch, "preset": preset, "micro_batch": 8192}
            runs[preset] = {
                k: step({**s, **v}) for k, v in GPU_STEPS.items() if k in (args.only or GPU_STEPS)
            }
    else:
        batch = {"sequences": 8, "min_len": 150, "max_len": 600}
        s = {**base, **batch, "preset": "cpu-small", "micro_batch": 2048}
        runs = {"cpu-small": {
            "old_head": step({**s, "head": "old"}), "new_head": step(s),
            "new_head_compile_on": step({**s, "compile": True}),
            "compile_off_over_on_side_by_side": step({**s, "compile": "side_by_side", "repeats": 6}),
        }}  # fmt: skip
    result["steps"] = runs
    result["settings"] = (
        f"{batch['sequences']} random sequences of {batch['min_len']}-{batch['max_len']} tokens per step, "
        f"Qwen2 shapes {', '.join(runs)} ({PRESETS}: hidden, MLP, layers, heads, KV heads), vocabulary "
        f"{VOCAB}, tied embeddings, AdamW, {'bf16 autocast over fp32 weights' if gpu else 'fp32, 1 thread'}; "
        f"median of {args.repeats} steps after a warm-up step, each on a new batch, each setting in its "
        "own process with an empty inductor cache"
    )
    result["command"] = "python bench/bench_trainer.py " + " ".join(sys.argv[1:])
    key = "trainer_gpu" if gpu else "trainer"
    print(json.dumps({key: result}, indent=1))
    if args.out:
        merge_results(args.out, {key: result})


if __name__ == "__main__":
    main()
