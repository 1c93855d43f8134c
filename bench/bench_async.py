"""Async speedup and trainer idle fraction: the same optimizer steps with --max-staleness 0 (synchronous)
vs 1, 2, 4, run one after the other against one vLLM server on the same workload.

    python bench/bench_async.py [--staleness 0 1 2 4] [--steps 8] [--out bench/results.json]

Cores: the server's CPU threads are pinned to core 0 (VLLM_CPU_OMP_THREADS_BIND=0) and the trainer runs
under `taskset -c 1` with OMP_NUM_THREADS=1 (its rollout thread and sandbox processes inherit core 1),
so generation and training each own one core and the best async speedup is ~2x when they take equal
time. Each run starts by pushing the base weights into the server (the trainer syncs at start with
--vllm-url), so every setting starts from the same model.

Figures, from each run's metrics.jsonl:
  1. wall seconds of the training loop (sum of perf/step_s; process start-up excluded) and the speedup
     over staleness 0; mean reward over the same steps, so speed is not bought with learning.
  2. trainer idle fraction in steady state: sum of perf/wait_s / sum of perf/step_s after --skip steps.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a file from anywhere
from bench.results import merge_results  # noqa: E402
from vllm_server import start_vllm_server  # noqa: E402


def run_trainer(url: str, staleness: int, out_dir: Path, args) -> dict:
    cmd = [
        "taskset", "-c", args.trainer_core, sys.executable, str(REPO / "train_async_grpo.py"),
        "--model", args.model, "--env", args.env, "--vllm-url", url, "--output-dir", str(out_dir),
        "--max-staleness", str(staleness), "--max-steps", str(args.steps), "--seed", "0",
        "--prompts-per-step", str(args.prompts_per_step), "--num-generations", str(args.num_generations),
        "--max-turns", str(args.max_turns), "--max-context", str(args.max_context), "--lr", str(args.lr),
        "--save-every", "100000", "--log-completions-every", "100000",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1")
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    process_s = time.monotonic() - t0
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "perf/step_s" in m]  # not eval-only lines
    steady = steps[args.skip :]
    return {
        "loop_s": round(sum(s["perf/step_s"] for s in steps), 1),
        "process_s": round(process_s, 1),
        "reward_mean": round(sum(s["rollout/reward_mean"] for s in steps) / len(steps), 3),
        "idle_frac": round(sum(s["perf/wait_s"] for s in steady) / sum(s["perf/step_s"] for s in steady), 3),
        "train_s_per_step": round(sum(s["perf/train_s"] for s in steady) / len(steady), 2),
        "gen_tokens_per_step": round(sum(s["rollout/generated_tokens"] for s in steady) / len(steady)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="models/tiny-warm", help="model the server serves and the trainer trains"
    )
    p.add_argument("--env", default="retool", help="environment (envs/)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="settings to compare")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per setting")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the idle fraction")
    p.add_argument("--prompts-per-step", type=int, default=2, help="groups per step")
    p.add_argument("--num-generations", type=int, default=4, help="completions per group")
    p.add_argument("--max-turns", type=int, default=2, help="model turns per completion")
    p.add_argument("--max-context", type=int, default=1024, help="prompt + completion tokens")
    p.add_argument("--lr", type=float, default=1e-5, help="trainer learning rate")
    p.add_argument("--server-core", default="0", help="core(s) for vLLM's CPU threads")
    p.add_argument("--trainer-core", default="1", help="core(s) for the trainer (taskset -c)")
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    runs = {}
    with start_vllm_server(
        args.model, cpu_threads_bind=args.server_core, max_model_len=args.max_context, log_dir=tmp
    ) as server:
        for s in args.staleness:
            runs[s] = run_trainer(server.url, s, tmp / f"staleness-{s}", args)
            print(f"max-staleness {s}: {runs[s]}", flush=True)

    base = runs[args.staleness[0]]["loop_s"]
    settings = (
        f"{args.model}, --env {args.env}, {args.steps} steps x {args.prompts_per_step} prompts x "
        f"{args.num_generations} generations, --max-turns {args.max_turns}, "
        f"--max-context {args.max_context}; vLLM threads on core {args.server_core}, "
        f"trainer `taskset -c {args.trainer_core}` OMP_NUM_THREADS=1; "
        "one server, settings run one after the other"
    )
    command = "python bench/bench_async.py " + " ".join(sys.argv[1:])
    results = {
        "async_speedup": {
            **{f"staleness_{s}": {"loop_s": r["loop_s"], "speedup": round(base / r["loop_s"], 2),
                                  "reward_mean": r["reward_mean"]} for s, r in runs.items()},
            "settings": settings, "command": command,
        },
        "trainer_idle_frac": {
            **{f"staleness_{s}": r["idle_frac"] for s, r in runs.items()},
            "settings": f"steady state: steps {args.skip + 1}..{args.steps}; " + settings,
            "command": command,
        },
    }  # fmt: skip
    print(json.dumps(results, indent=2))
    print(json.dumps({f"staleness_{s}": r for s, r in runs.items()}, indent=2))
    if args.out:
        merge_results(args.out, results)


if __name__ == "__main__":
    main()
