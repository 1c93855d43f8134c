"""The per-sync fidelity check's cost as a share of a training step (goal ≤ 5 %).

    python bench/bench_fidelity.py [--model models/tiny-warm] [--repeats 5] [--out bench/results.json]

One real vLLM server on the model; the check is what fidelity.SyncChecks runs for each
server after a sync: 8 seeded PER_SYNC_TOKENS (4)-token completions of 32-token windows of the probe
prompts (fidelity.per_sync_prompts) with their top-20 logprobs (fidelity.probe, run request only), then the
trainer's re-score of them (fidelity.verify_server). The request runs beside the next step's forward and
backward; the re-score is on the trainer's path (the figure: rescore_s / train_step_s). The step is
one train_step on a batch of the default shape (--prompts-per-step 8 × --num-generations 8 sequences
of ~300 tokens, random ids: the cost does not depend on them). Medians over --repeats, in the same
run. Prints one JSON object; with --out it is merged into that file.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train_async_grpo.py: before torch loads OpenMP

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
from bench.results import merge_results  # noqa: E402
from chat_format import ChatTemplate  # noqa: E402
from envs import episode_maker  # noqa: E402
from envs.data import load_rows  # noqa: E402
from fidelity import PER_SYNC_PROMPTS, PER_SYNC_TOKENS, per_sync_prompts, probe, verify_server  # noqa: E402
from sampling import Sampling  # noqa: E402
from trainer import train_step  # noqa: E402
from vllm_server import start_vllm_server  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-warm")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()
    cpu = torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    make_episode, _ = episode_maker("retool", 2, True, 0)
    rows = load_rows("data/retool_train.jsonl")
    template = ChatTemplate(
        AutoTokenizer.from_pretrained(args.model), getattr(make_episode(rows[0]), "tools", None)
    )
    startup = [template.prompt_ids(make_episode(r).messages) for r in rows[:PER_SYNC_PROMPTS]]
    prompts = per_sync_prompts(startup)
    gen = torch.Generator().manual_seed(0)
    seqs = [
        {"ids": torch.randint(0, 500, (300,), generator=gen).tolist(), "mask": [0] * 150 + [1] * 150,
         "behaviour": [-2.0] * 300, "advantage": 1.0 if i % 2 else -1.0}
        for i in range(64)
    ]  # fmt: skip
    step_args = SimpleNamespace(
        micro_batch_tokens=4096, temperature=1.0, top_p=1.0, top_k=0, eps_low=0.2, eps_high=0.28, is_cap=2.0,
        loss_norm="token", kl_beta=0.0, max_grad_norm=1.0, mini_batches=1, compute_dtype="fp32",
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the full step; the server stays in step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    server = start_vllm_server(args.model, log_dir="runs/bench-fidelity-logs", timeout_s=600)
    try:
        request_s, rescore_s, step_s = [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            samples = probe(server.url, args.model, prompts, Sampling(), 0, False, PER_SYNC_TOKENS)
            t1 = time.perf_counter()
            verify_server(server.url, samples, model, False, 1, cpu)
            request_s.append(t1 - t0)
            rescore_s.append(time.perf_counter() - t1)
            t0 = time.perf_counter()
            train_step(model, None, optimizer, scheduler, seqs, step_args, 0, 1, cpu)
            step_s.append(time.perf_counter() - t0)
    finally:
        server.stop()
    request, rescore, step = map(statistics.median, (request_s, rescore_s, step_s))
    result = {
        "fidelity_check_share_of_step": {
            "request_s": round(request, 3), "rescore_s": round(rescore, 3), "train_step_s": round(step, 3),
            "share": round(rescore / step, 4), "request_share": round(request / step, 4),
            "command": "python bench/bench_fidelity.py",
            "settings": {"model": args.model, "repeats": args.repeats},
        }
    }  # fmt: skip
    print(json.dumps(result))
    if args.out:
        merge_results(args.out, result)


if __name__ == "__main__":
    main()
