"""Rollout throughput, measured side by side against one real vLLM server on the tiny model.

    python bench/bench_rollout.py [--url http://127.0.0.1:8000] [--model models/tiny]

1. Client overhead: generated tok/s of our AsyncRolloutWorker vs a bare aiohttp loop sending the same
   token-id requests (same body: prompt, max_tokens, ignore_eos, stop token; same concurrency) to the
   same server, alternating several times (medians: the server alone varies ±20 % run to run here).
2. Scaling: bare tok/s at concurrency 1, 8, 32, 64.
3. Per-request seeds (what the trainer sends: sampling.request_seed): bare tok/s with a distinct seed per
   request vs none, alternating, concurrency 64 (a seeded request gets its own torch.Generator in vLLM).
Prints one JSON object; with --out it is merged into that results file.
"""

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
from bench.results import merge_results  # noqa: E402
from chat_format import ChatTemplate  # noqa: E402
from envs import load_env  # noqa: E402
from rollout import AsyncRolloutWorker, VLLMClient  # noqa: E402
from sampling import Sampling, request_seed  # noqa: E402
from vllm_server import start_vllm_server  # noqa: E402


async def bare_loop(
    url: str, model: str, prompt_ids: list[int], n: int, concurrency: int, gen_len: int, stop_ids: list[int],
    seeded: bool = False,
):  # fmt: skip
    # The body the worker's client sends (skip_special_tokens=False costs the server ~4 %, and the stop
    # token ends ~10 % of these random completions early): only the client side differs.
    body = {
        "model": model, "prompt": prompt_ids, "max_tokens": gen_len, "logprobs": 0,
        "return_token_ids": True, "skip_special_tokens": False, "ignore_eos": True,
        "stop_token_ids": stop_ids, **Sampling().request_fields(),
    }  # fmt: skip
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    # Idle pooled connections go before uvicorn's 5 s keep-alive closes them under a request (as VLLMClient)
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int):
            nonlocal tokens
            seed = {"seed": request_seed(0, i, 0, 0)} if seeded else {}
            async with sem, session.post(f"{url}/v1/completions", json={**body, **seed}) as r:
                tokens += len((await r.json())["choices"][0]["token_ids"])

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
    return tokens / (time.monotonic() - t0)


def worker_tok_s(url: str, model: str, n_requests: int, concurrency: int, gen_len: int, group_size: int = 8):
    tokenizer = AutoTokenizer.from_pretrained(model)
    env = load_env("math")
    row = {"question": "What is 4821 * 937?", "answer": "4517277"}
    template = ChatTemplate(tokenizer)
    prompt_len = len(template.prompt_ids(env.make_episode(row).messages))
    n_groups = n_requests // group_size
    worker = AsyncRolloutWorker(
        VLLMClient([url], model, max_inflight=concurrency), template, env.make_episode,
        itertools.repeat(row, n_groups), num_generations=group_size, groups_per_version=n_groups,
        max_staleness=0, max_turns=1, max_context=prompt_len + gen_len, sampling={"ignore_eos": True},
    )  # fmt: skip
    t0 = time.monotonic()
    worker.start()
    groups = [worker.queue.get(timeout=600) for _ in range(n_groups)]
    elapsed = time.monotonic() - t0
    worker.stop()
    tokens = sum(len(t.generated_ids) for g in groups for c in g.completions for t in c.turns)
    return tokens / elapsed, template.prompt_ids(env.make_episode(row).messages), template.stop_token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server; default: start one")
    p.add_argument("--model", default="models/tiny", help="model the server serves")
    p.add_argument("--requests", type=int, default=256, help="requests per measurement")
    p.add_argument("--gen-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--repeats", type=int, default=7, help="alternating runs of each client")
    p.add_argument("--out", help="merge the figures into this JSON file")
    args = p.parse_args()
    server = None if args.url else start_vllm_server(args.model)
    url = args.url or server.url
    try:
        # Warm up both paths once, then alternate so drift in the machine hits both alike.
        _, prompt_ids, stop_ids = worker_tok_s(url, args.model, 64, 64, args.gen_len)
        asyncio.run(bare_loop(url, args.model, prompt_ids, 64, 64, args.gen_len, stop_ids))
        # Run-to-run noise of the server alone is ±20 % here: alternate several times, report medians.
        ours_runs, bare_runs = [], []
        for _ in range(args.repeats):
            ours_runs.append(worker_tok_s(url, args.model, args.requests, 64, args.gen_len)[0])
            bare_runs.append(
                asyncio.run(bare_loop(url, args.model, prompt_ids, args.requests, 64, args.gen_len, stop_ids))
            )
        seeded_runs, unseeded_runs = [], []
        for _ in range(args.repeats):
            for seeded, runs in ((True, seeded_runs), (False, unseeded_runs)):
                tok_s = bare_loop(
                    url, args.model, prompt_ids, args.requests, 64, args.gen_len, stop_ids, seeded
                )
                runs.append(asyncio.run(tok_s))
        scaling = {}
        for c in (1, 8, 32, 64):
            bare = bare_loop(url, args.model, prompt_ids, max(32, 4 * c), c, args.gen_len, stop_ids)
            scaling[str(c)] = round(asyncio.run(bare), 1)
    finally:
        if server:
            server.stop()
    ours_tok_s, bare_tok_s = statistics.median(ours_runs), statistics.median(bare_runs)
    results = {
        "rollout_client_overhead": {
            "worker_tok_s": round(ours_tok_s, 1),
            "bare_aiohttp_tok_s": round(bare_tok_s, 1),
            "ratio": round(ours_tok_s / bare_tok_s, 3),
            "worker_runs": [round(x) for x in ours_runs],
            "bare_runs": [round(x) for x in bare_runs],
            "settings": f"{args.requests} requests x {args.gen_len} tokens, concurrency 64, prompt "
            f"{len(prompt_ids)} tokens, medians of {args.repeats} alternating runs",
            "command": "python bench/bench_rollout.py",
        },
        "rollout_scaling_tok_s": {**scaling, "command": "python bench/bench_rollout.py"},
        "rollout_seeded_requests": {
            "seeded_tok_s": round(statistics.median(seeded_runs), 1),
            "unseeded_tok_s": round(statistics.median(unseeded_runs), 1),
            "ratio": round(statistics.median(seeded_runs) / statistics.median(unseeded_runs), 3),
            "settings": f"bare loop, {args.requests} requests x {args.gen_len} tokens, concurrency 64, "
            f"medians of {args.repeats} alternating runs",
            "command": "python bench/bench_rollout.py",
        },
    }
    print(json.dumps(results, indent=2))
    if args.out:
        merge_results(args.out, results)


if __name__ == "__main__":
    main()
