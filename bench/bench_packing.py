"""Figure 2, packed training: the trainer's tokens/s with packed micro-batches over one sequence per
forward, and over this CPU's matmul bound.

    python bench/bench_packing.py [--rows 512 2048 4096] [--repeats 5] [--widen 1] [--out bench/results.json]

One batch of --sequences seeded random sequences (lengths uniform in [--min-len, --max-len], the shape of
a GRPO batch: prompt + completion, every sequence alone shorter than the smallest row) is trained by
trainer.train_step (fp32, AdamW, the script's defaults) in these settings, alternated within each
repeat so that a busy machine slows them alike:
  unpacked      --micro-batch-tokens 1: every sequence in a forward of its own
  packed R      rows of ≤ R tokens, the trainer's attention (trainer.load_models: per-sequence sdpa on
                CPU, cost Σ len²)
  dense R       the same rows on transformers' own sdpa, which masks a row with a dense T × T
                block-diagonal causal mask (cost (Σ len)²): the trainer before per-sequence attention
Per repeat: tokens/s of each; ratios packed / unpacked and dense / unpacked within the repeat; medians.
Seconds are this process's CPU seconds on one torch thread (bench_async.py's trainer also runs on one
core): on an idle core they are the wall-clock seconds, and on a shared machine (this one is) they leave
out the time other jobs held the core, which wall-clock ratios of runs minutes apart would not.

FLOP bound: the step's matmul FLOPs (forward + backward = 3 × forward: 2 · in · out per token of every
Linear incl. the LM head, and each sequence's causal attention, 2 · len² · heads · head_dim per layer)
over the FLOP/s this CPU reaches with plain matmuls of the same sizes (every Linear's forward and its two
backward matmuls on a row of R tokens). `over_bound` = trainer tokens/s / bound tokens/s:
1.0 would be a trainer doing nothing but its matmuls at the machine's matmul speed (one core's).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
import train_async_grpo as script  # noqa: E402
from bench.bench_weight_sync import widened_model  # noqa: E402
from bench.results import merge_results  # noqa: E402
from trainer import load_models, train_step  # noqa: E402


def random_sequences(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """train_step's sequences: a 16-token prompt (mask 0), the rest trained, advantages ±1."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for k in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        seqs.append({
            "ids": torch.randint(0, vocab, (length,), generator=gen).tolist(),
            "mask": [0] * 16 + [1] * (length - 16),
            "behaviour": [0.0] * 16 + [-2.0] * (length - 16),
            "advantage": 1.0 if k % 2 else -1.0,
        })  # fmt: skip
    return seqs


def step_seconds(model, optimizer, scheduler, seqs: list[dict], args) -> float:
    t0 = time.process_time()
    train_step(model, None, optimizer, scheduler, seqs, args, 0, 1, torch.device("cpu"))
    return time.process_time() - t0


def median_ratio(slow_s: list[float], fast_s: list[float]) -> float:
    """Speed of `fast` over `slow`, repeat by repeat (measured side by side), then the median."""
    return statistics.median(a / b for a, b in zip(slow_s, fast_s))


def linear_shapes(model) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def step_flops(model, seqs: list[dict]) -> float:
    """Forward + backward matmul FLOPs of one pass over `seqs` (backward = 2 × forward)."""
    c = model.config
    tokens = sum(len(s["ids"]) for s in seqs)
    linear = 2 * tokens * sum(i * o for i, o in linear_shapes(model))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # causal: QKᵀ and PV over the lower triangle, len²/2 each, 2 FLOPs per multiply-add
    attention = sum(2 * len(s["ids"]) ** 2 * c.num_attention_heads * head_dim for s in seqs)
    return 3 * (linear + c.num_hidden_layers * attention)


def matmul_flops_per_s(model, tokens: int, repeats: int = 5) -> float:
    """FLOP/s of plain matmuls of the model's Linear sizes on a row of `tokens`: per Linear, the forward
    x Wᵀ and the backward's g W and gᵀ x (median of `repeats`, after a warm-up)."""
    ops = []
    for i, o in linear_shapes(model):
        x, w, g = torch.randn(tokens, i), torch.randn(o, i), torch.randn(tokens, o)
        ops.append((x, w, g))

    def once() -> float:
        t0 = time.process_time()
        for x, w, g in ops:
            x @ w.T, g @ w, g.T @ x
        return time.process_time() - t0

    once()
    seconds = statistics.median(once() for _ in range(repeats))
    return 3 * 2 * tokens * sum(i * o for i, o in linear_shapes(model)) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny", help="model directory (trained from its weights)")
    p.add_argument("--widen", type=int, default=1, help="hidden/MLP sizes x this (bench_weight_sync's copy)")
    p.add_argument("--rows", type=int, nargs="+", default=[512, 2048, 4096], help="packed row lengths")
    p.add_argument("--sequences", type=int, default=64, help="sequences in the batch")
    p.add_argument("--min-len", type=int, default=64, help="shortest sequence (tokens)")
    p.add_argument("--max-len", type=int, default=448, help="longest sequence (tokens)")
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats (medians are reported)")
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()
    if not 16 < args.min_len <= args.max_len:  # random_sequences: a 16-token prompt, then trained tokens
        p.error(
            f"need 16 < --min-len <= --max-len (a 16-token prompt, then a trained token); got "
            f"{args.min_len}, {args.max_len}"
        )
    torch.set_num_threads(1)
    torch.manual_seed(0)

    tmp = tempfile.TemporaryDirectory(prefix="bench-packing-")
    model_dir = widened_model(args.model, args.widen, Path(tmp.name)) if args.widen > 1 else args.model
    train_args = script.parser.parse_args(["--model", model_dir, "--lr", "1e-6"])
    train_args.compute_dtype = "fp32"
    packed_model, _, _ = load_models(train_args, None, torch.device("cpu"), 1)
    dense_model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )  # fmt: skip
    models = {
        "packed": (packed_model, *script.make_optimizer(packed_model, train_args)),
        "dense": (dense_model, *script.make_optimizer(dense_model, train_args)),
    }
    seqs = random_sequences(
        args.sequences, args.min_len, args.max_len, packed_model.config.vocab_size
    )  # fmt: skip
    tokens = sum(len(s["ids"]) for s in seqs)
    settings = [("unpacked", "packed", 1)] + [
        (f"{kind}_{r}", kind, r) for r in args.rows for kind in ("packed", "dense")
    ]
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in settings}
    for rep in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, kind, row in settings:
            train_args.micro_batch_tokens = row
            s = step_seconds(*models[kind], seqs, train_args)
            if rep:
                seconds[name].append(s)
        if rep:
            print(f"repeat {rep}, tok/s:", ", ".join(f"{n} {tokens / v[-1]:.0f}" for n, v in seconds.items()))

    tok_s = {name: tokens / statistics.median(v) for name, v in seconds.items()}
    flops = step_flops(packed_model, seqs)
    result: dict = {
        "model": args.model,
        "widen": args.widen,
        "tokens": tokens,
        "unpacked_tok_s": round(tok_s["unpacked"]),
    }
    for r in args.rows:
        rate = matmul_flops_per_s(packed_model, r)
        bound_tok_s = rate * tokens / flops
        result[f"row_{r}"] = {
            "packed_tok_s": round(tok_s[f"packed_{r}"]),
            "dense_tok_s": round(tok_s[f"dense_{r}"]),
            "packed_over_unpacked": round(median_ratio(seconds["unpacked"], seconds[f"packed_{r}"]), 2),
            "dense_over_unpacked": round(median_ratio(seconds["unpacked"], seconds[f"dense_{r}"]), 2),
            "matmul_gflop_s": round(rate / 1e9, 1),
            "bound_tok_s": round(bound_tok_s),
            "over_bound": round(tok_s[f"packed_{r}"] / bound_tok_s, 3),
        }
    result["settings"] = (
        f"{args.sequences} sequences of {args.min_len}-{args.max_len} tokens ({tokens} tokens), one "
        f"train_step each (fp32, AdamW), CPU seconds of one thread, medians of {args.repeats} "
        "alternating repeats"
    )
    result["command"] = "python bench/bench_packing.py " + " ".join(sys.argv[1:])
    key = "packing" if args.widen == 1 else f"packing_widen{args.widen}"
    print(json.dumps({key: result}, indent=1))
    if args.out:
        merge_results(args.out, {key: result})
    tmp.cleanup()


if __name__ == "__main__":
    main()
