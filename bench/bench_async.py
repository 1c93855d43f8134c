"""Figure 1, async training: speedup over synchronous, judged against its bound; the trainer's step time
with rollouts beside it; length bias on a heavy-tailed workload. One vLLM server, every run one after
the other, `--repeats` runs per setting, medians.

    python bench/bench_async.py [--staleness 0 1 2 4] [--repeats 1] [--steps 12] [--out bench/results.json]
    python bench/bench_async.py --repeats 3 --out bench/results.json   # README's figure 1 (`make bench-full`)
    python bench/bench_async.py --staleness 0 1 --steps 3 --skip 1      # a smoke run, ~3 min

One repeat (the default, `make bench`: 9 runs, ~4 min on 2 cores) gives every figure; three (11:38)
give medians and a spread of seconds per group, which README's table is built from.

Cores: the server (every process of it, and its OMP threads) runs on --server-core, the trainer
runs under `taskset -c --trainer-core` with OMP_NUM_THREADS=1, and `--rollout-cpus --server-core` moves
its rollout process (and the sandbox and answer-checking processes it starts) onto the server's core,
so training owns its core and generation-side work shares the generator's.

Per --max-staleness setting s (workload `equal`: retool, the same optimizer steps for every s):
  gen_tok_s         generated tokens / seconds over the steady steps (after --skip)
  in_flight         mean vLLM requests in flight (perf/requests_in_flight, weighted by step time)
  train_s           mean trainer step time (perf/train_s); at s = 0 nothing generates while the
                    trainer trains (admission waits for the new version), so s = 0 gives train_s alone
  inflation         train_s(s) / train_s(0); goal ≤ 1.1
  check_s           mean seconds the per-sync check held the trainer (fidelity/seconds, inside train_s):
                    its re-score, and the wait for its answer where the server answers late
  speedup           seconds per trained group at s = 0 / at s
  bound, efficiency a synchronous run at the SAME generation concurrency as s ((s + 1) × the groups per
                    step, so vLLM batches as many requests) gives gen = its wait per step and train = its
                    train_s; overlapping them can at best turn gen + train into max(gen, train):
                    bound = (gen + train) / max(gen, train). overlap = that run's seconds per group / s's;
                    efficiency = overlap / bound (goal ≥ 0.9). `speedup` above also contains the better
                    batching; `overlap` does not.
  generating_async_over_sync  requests in flight and tok/s of the async server (generating all the
                    time) over the sync run's while it generates (its wait): the bound assumes 1.0, but
                    at staleness s at most (s + 1) × the groups per step are live, and the batch being
                    trained is not generating.
Heavy-tailed workload (bench/heavy_tail_env.py, data/heavy_tail.jsonl: rows needing 1 to 4 tool round
trips) at --heavy-staleness, with and without --drop-stale: trained / admitted completion length
(goal ≥ 0.95 without --drop-stale), groups dropped, token lag mean and max, seconds per trained group.
Each run starts by pushing the base weights into the server, so every run starts from the same model.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a file from anywhere
from bench.results import merge_results  # noqa: E402
from vllm_server import start_vllm_server  # noqa: E402


def run_trainer(url: str, out_dir: Path, args, staleness: int, prompts: int, steps: int, *extra: str) -> list:
    """One training run of `steps` steady-state steps; their per-step metrics lines. Left out before them:
    --skip steps, and at staleness s at least s + 1: those batches were all admitted at once, at version
    0, and generated side by side, a burst the steady state never sees again (with 2 left out of 8 steps,
    s = 4 measured 0.16 s a group, the steady state 0.21-0.23)."""
    skip = max(args.skip, staleness + 1)
    script = "bench/heavy_tail_env.py" if "heavy_tail" in extra else "train_async_grpo.py"
    cmd = [
        "taskset", "-c", args.trainer_core, sys.executable, str(REPO / script),
        "--model", args.model, "--vllm-url", url, "--output-dir", str(out_dir),
        "--max-staleness", str(staleness), "--max-steps", str(skip + steps), "--seed", "0",
        "--prompts-per-step", str(prompts), "--num-generations", str(args.num_generations),
        "--max-turns", str(args.max_turns), "--max-context", str(args.max_context), "--lr", str(args.lr),
        "--save-every", "100000", "--log-completions-every", "100000", "--keep-zero-variance",
        "--rollout-cpus", args.server_core, *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1")
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    steps_m = [m for m in map(json.loads, lines) if "perf/step_s" in m]  # not eval-only lines
    return steps_m[min(skip, len(steps_m) - 1) :]


def summarize(steps: list[dict], prompts: int) -> dict:
    n_trained = sum(s["rollout/completions"] for s in steps)
    n_admitted = sum(s["rollout/admitted_completions"] for s in steps)
    trained_len = sum(s["rollout/completion_len_mean"] * s["rollout/completions"] for s in steps) / n_trained
    admitted_len = sum(s["rollout/admitted_len_mean"] * s["rollout/admitted_completions"] for s in steps)
    # Totals over the steady steps, not medians: an async run's steps alternate between one that waits
    # for its batch and one whose batch is there, and a median of such a series lands on either.
    seconds = sum(s["perf/step_s"] for s in steps)
    return {
        "s_per_group": seconds / (len(steps) * prompts),
        "gen_tok_s": sum(s["rollout/generated_tokens"] for s in steps) / seconds,
        "in_flight": sum(s["perf/requests_in_flight"] * s["perf/step_s"] for s in steps) / seconds,
        "train_s": sum(s["perf/train_s"] for s in steps) / len(steps),
        "wait_s": sum(s["perf/wait_s"] for s in steps) / len(steps),
        "check_s": sum(s.get("fidelity/seconds", 0.0) for s in steps) / len(steps),  # inside train_s
        "len_ratio": trained_len / (admitted_len / n_admitted),
        "dropped": sum(s["rollout/dropped_stale"] for s in steps),
        "token_lag_mean": sum(s["rollout/token_lag_mean"] for s in steps) / len(steps),
        "token_lag_max": max(s["rollout/token_lag_max"] for s in steps),
        "reward_mean": sum(s["rollout/reward_mean"] for s in steps) / len(steps),
    }


def medians(runs: list[dict]) -> dict:
    """Per key, the median over repeats (rounded), plus the spread of seconds per group."""
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    out["s_per_group_range"] = [round(min(r["s_per_group"] for r in runs), 3),
                                round(max(r["s_per_group"] for r in runs), 3)]  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="models/tiny-warm", help="model the server serves and the trainer trains"
    )
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="settings (first: 0)")
    p.add_argument("--repeats", type=int, default=1, help="runs per setting (medians; README's table: 3)")
    p.add_argument("--steps", type=int, default=12, help="measured optimizer steps per run at the base batch")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps before them (at staleness s: ≥ s + 1)")
    p.add_argument("--prompts-per-step", type=int, default=2, help="groups per step")
    p.add_argument("--num-generations", type=int, default=4, help="completions per group")
    p.add_argument("--max-turns", type=int, default=2, help="model turns per completion")
    p.add_argument("--max-context", type=int, default=1024, help="prompt + completion tokens")
    p.add_argument("--lr", type=float, default=1e-5, help="trainer learning rate")
    p.add_argument("--heavy-staleness", type=int, default=1, help="--max-staleness of the heavy-tailed runs")
    p.add_argument("--tool-turn-s", type=float, default=3.0, help="seconds per extra tool round trip (heavy)")
    p.add_argument("--server-core", default="0", help="core(s) for vLLM's CPU threads and the rollout side")
    p.add_argument("--trainer-core", default="1", help="core(s) for the trainer (taskset -c)")
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()
    if args.staleness[0] != 0:
        p.error("--staleness must start with 0 (the synchronous baseline)")

    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    P, runs, same_conc, heavy = args.prompts_per_step, {}, {}, {}
    t0 = time.monotonic()
    with start_vllm_server(
        args.model, cpus=args.server_core, max_model_len=args.max_context, log_dir=tmp
    ) as server:
        for rep in range(args.repeats):  # repeats outermost: drift in the machine's load hits every setting
            for s in args.staleness:
                d = tmp / f"r{rep}-s{s}"
                runs.setdefault(s, []).append(
                    summarize(run_trainer(server.url, d, args, s, P, args.steps), P)
                )
                print(f"repeat {rep} staleness {s}: {runs[s][-1]}", flush=True)
                if s > 0:  # synchronous at the same concurrency: (s + 1) × the groups per step
                    steps = max(3, args.steps // (s + 1))
                    d = tmp / f"r{rep}-sync{s}"
                    same_conc.setdefault(s, []).append(
                        summarize(run_trainer(server.url, d, args, 0, P * (s + 1), steps), P * (s + 1))
                    )
                    print(f"repeat {rep} sync at staleness {s}'s concurrency: {same_conc[s][-1]}", flush=True)
            os.environ["BENCH_TOOL_TURN_S"] = str(args.tool_turn_s)
            for drop in (False, True):
                extra = ("--env", "heavy_tail", "--dataset", "data/heavy_tail.jsonl", "--max-turns", "4")
                extra += ("--drop-stale",) if drop else ()
                d = tmp / f"r{rep}-heavy-{'drop' if drop else 'keep'}"
                steps = run_trainer(server.url, d, args, args.heavy_staleness, P, args.steps, *extra)
                heavy.setdefault(drop, []).append(summarize(steps, P))
                print(f"repeat {rep} heavy-tailed drop_stale={drop}: {heavy[drop][-1]}", flush=True)

    base = medians(runs[0])
    figure = {"staleness_0": {**base, "speedup": 1.0, "inflation": 1.0}}
    for s in args.staleness[1:]:
        r, c = medians(runs[s]), medians(same_conc[s])
        gen, train = c["wait_s"], c["train_s"]
        bound = (gen + train) / max(gen, train, 1e-9)
        overlap = c["s_per_group"] / r["s_per_group"]
        # What the bound takes for granted: the async run generating as fast as the sync run does while it
        # generates (its wait). The async server generates all the time; the sync one only in its wait.
        sync_step = c["s_per_group"] * P * (s + 1)
        generating = {
            "in_flight": round(r["in_flight"] / (c["in_flight"] * sync_step / gen), 2),
            "tok_s": round(r["gen_tok_s"] / (c["gen_tok_s"] * sync_step / gen), 2),
        }
        figure[f"staleness_{s}"] = {
            **r, "speedup": round(base["s_per_group"] / r["s_per_group"], 2),
            "inflation": round(r["train_s"] / base["train_s"], 2),
            "sync_same_concurrency": c, "bound": round(bound, 2), "overlap": round(overlap, 2),
            "efficiency": round(overlap / bound, 2), "generating_async_over_sync": generating,
        }  # fmt: skip
    settings = (
        f"{args.model}, retool, {P} prompts x {args.num_generations} generations a step, "
        f"--max-turns {args.max_turns}, --max-context {args.max_context}, --keep-zero-variance; "
        f"{args.steps} steady steps after {args.skip} (at staleness s: s + 1); "
        f"medians of {args.repeats} repeats; vLLM threads and "
        f"--rollout-cpus on core {args.server_core}, trainer `taskset -c {args.trainer_core}` "
        f"OMP_NUM_THREADS=1; one server, runs one after the other"
    )
    command = "python bench/bench_async.py " + " ".join(sys.argv[1:])
    results = {
        "async": {**figure, "repeats": args.repeats, "settings": settings, "command": command},
        "async_heavy_tail": {
            "keep": medians(heavy[False]), "drop_stale": medians(heavy[True]),
            "settings": f"bench/heavy_tail_env.py on data/heavy_tail.jsonl (1-4 tool round trips, "
            f"{args.tool_turn_s} s each after the first), --max-staleness {args.heavy_staleness}, "
            f"--max-turns 4; " + settings,
            "command": command,
        },
    }  # fmt: skip
    print(json.dumps(results, indent=2))
    print(f"bench_async: {time.monotonic() - t0:.0f} s", flush=True)
    if args.out:
        merge_results(args.out, results)
    shutil.rmtree(tmp, ignore_errors=True)  # each trainer run's output dir: ~0.1 GB a run


if __name__ == "__main__":
    main()
