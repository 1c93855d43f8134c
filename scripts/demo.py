"""The demo: GRPO with a code interpreter teaches the tiny model to use the tool; without it, nothing.

    make demo                      # set-up (venv, tiny models) and then this script
    python scripts/demo.py         # this script alone, once the models exist
    python scripts/demo.py --update-docs   # refresh the committed figures in docs/ (README shows them)
    python scripts/demo.py --retool-steps 4 --math-steps 2 --eval-limit 8   # a quick smoke run

Two runs of the real trainer (train_async_grpo.py, as subprocesses) on one vLLM server started here (a
start-up is ~45 s on 2 cores; each run pushes its own weights into the server before its first rollout,
so the second starts from the warm start too, not from the first's weights), both from the warm start
models/tiny-demo, which knows the tool-call format but rarely uses it:
  1. --env retool: the code_interpreter tool is offered;
  2. --env math:   the same problems, no tool.
Each evaluates greedily on held-out problems at the start, every --eval-every steps and at the end. Then
a summary table (accuracy and tool-call rate, before → after), demo_summary.json and one figure per run
(reward, held-out accuracy, tool calls per completion, staleness over steps) in the runs dir, and the
rollout viewer's page of the retool run (scripts/view_rollouts.py: its logged completions token by token).
Only --update-docs writes the figures and summary into docs/: they are committed, and a researcher's
`make demo` must not leave binary diffs in their tree.
"""

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from view_rollouts import main as write_viewer_page  # noqa: E402  (scripts/ is this script's dir)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from vllm_server import healthy, start_vllm_server  # noqa: E402

# fmt: off
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="models/tiny-demo", help="warm start for both runs")
parser.add_argument("--runs-dir", default="runs/demo", help="the two runs' output dirs go here (replaced)")
parser.add_argument("--figures-dir", help="figures and demo_summary.json go here (default: --runs-dir)")
parser.add_argument("--update-docs", action="store_true",
                    help="write them into docs/ instead, over the committed ones (to refresh those)")
parser.add_argument("--retool-steps", type=int, default=20, help="GRPO steps of the run with the tool")
parser.add_argument("--math-steps", type=int, default=6, help="GRPO steps of the run without the tool")
parser.add_argument("--eval-every", type=int, default=5, help="held-out eval every N steps (and start, end)")
parser.add_argument("--eval-limit", type=int, default=50, help="held-out problems per eval")
parser.add_argument("--seed", type=int, default=0, help="trainer seed")
# The trainer's settings, the same for both runs (see train_async_grpo.py --help).
TRAIN_ARGS = [
    "--prompts-per-step", "4",    # groups per optimizer step
    "--num-generations", "8",     # G: enough spread in a group for a GRPO signal
    "--lr", "5e-4",               # 3e-3 garbled the tool-call code in one step (Adam moves all weights by lr)
    "--max-staleness", "1",       # rollouts of version v−1 still train step v: the async point
    "--max-context", "640",       # prompt ≈ 360 tokens with the tool schema; one tool round + answer fit
    "--max-turns", "2",           # tool call, then the answer
    "--temperature", "1.0",
    "--sandbox-workers", "4",
    "--save-every", "1000",       # only the final checkpoint
    "--batch-timeout", "300",     # fail (with the reason) rather than wait 10 min for a batch
]
# fmt: on


def run(env: str, steps: int, out: Path, url: str, args) -> float:
    """One training run as a subprocess on the server at `url`; returns its wall time in seconds."""
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl is appended to: start clean
    cmd = [
        sys.executable, str(REPO / "train_async_grpo.py"), "--model", args.model, "--env", env,
        "--output-dir", str(out), "--max-steps", str(steps), "--eval-every", str(args.eval_every),
        "--eval-limit", str(args.eval_limit), "--seed", str(args.seed), "--vllm-url", url, *TRAIN_ARGS,
    ]  # fmt: skip
    if env == "math":  # every group scores 0 without the tool: train on them (zero advantage, no update)
        cmd.append("--keep-zero-variance")  # rather than skip them all until the batch timeout
    print(f"\n=== {env}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=REPO).returncode
    if rc != 0:  # e.g. a batch timeout: the steps it logged are still summarized
        print(f"=== {env}: the trainer exited with {rc}", flush=True)
    return time.monotonic() - t0


def load_metrics(path: Path) -> list[dict]:
    """One dict per step (the last line wins for a repeated step), sorted by step."""
    by_step = {}
    if not path.is_file():  # the trainer exited before it opened the file
        return []
    for line in path.read_text().splitlines():
        if line.strip():
            m = json.loads(line)
            by_step[m["step"]] = m
    return [by_step[s] for s in sorted(by_step)]


def summarize(lines: list[dict], wall_s: float) -> dict:
    evals = [m for m in lines if "eval/accuracy" in m]
    train = [m for m in lines if "train/loss" in m]
    return {
        "steps": train[-1]["step"] if train else 0,
        "wall_s": round(wall_s, 1),
        "train_s": round(sum(m["perf/step_s"] for m in train), 1),
        "accuracy_before": evals[0]["eval/accuracy"],
        "accuracy_after": evals[-1]["eval/accuracy"],
        "tool_call_rate_before": evals[0]["eval/tool_call_rate"],
        "tool_call_rate_after": evals[-1]["eval/tool_call_rate"],
        "eval_steps": [m["step"] for m in evals],
        "eval_accuracy": [m["eval/accuracy"] for m in evals],
        "eval_tool_call_rate": [m["eval/tool_call_rate"] for m in evals],
    }


def plot(lines: list[dict], title: str, path: Path) -> None:
    """Four panels over steps: training reward, held-out accuracy (and tool-call rate), tool calls per
    training completion, staleness."""
    series = lambda key: [(m["step"], m[key]) for m in lines if key in m and math.isfinite(m[key])]  # noqa: E731
    panels = [
        ("training reward (mean)", ["rollout/reward_mean", "rollout/accuracy"]),
        ("held-out, greedy", ["eval/accuracy", "eval/tool_call_rate"]),
        ("tool calls per completion", ["rollout/tool_calls_per_completion"]),
        ("staleness (versions)", ["rollout/staleness_mean", "rollout/staleness_max"]),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    for ax, (name, keys) in zip(axes, panels):
        for k in keys:
            pts = series(k)
            if pts:
                ax.plot(*zip(*pts), marker=".", label=k.split("/")[1])
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figures_dir(args) -> Path:
    """Where the figures and demo_summary.json go: the runs dir unless told otherwise. docs/ holds the
    committed ones (README shows them), so only --update-docs writes there."""
    if args.update_docs and args.figures_dir:
        sys.exit("demo: --update-docs writes into docs/; give it or --figures-dir, not both")
    return REPO / ("docs" if args.update_docs else args.figures_dir or args.runs_dir)


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    if not (REPO / args.model / "config.json").is_file():  # else vLLM fails ~25 s in, in a traceback
        sys.exit(
            f"demo: {args.model}/config.json not found: build the demo's model with `make demo-model` "
            "(`make demo` does it for you)"
        )
    # `kill`/`timeout` (SIGTERM) ended this process alone: the trainer, orphaned, retried against the dead
    # server until --batch-timeout. As KeyboardInterrupt, subprocess.run kills the trainer and the `with`
    # stops the server; SIGINT too, which a shell leaves ignored for a background job.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    runs_dir, out_dir = REPO / args.runs_dir, figures_dir(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    summary = {"model": args.model, "eval_limit": args.eval_limit, "train_args": TRAIN_ARGS, "runs": {}}
    viewer_page = None
    # The server the trainer would launch (same context, same server seed), once for both runs.
    print(f"=== starting a vLLM server on {args.model}", flush=True)
    context = int(TRAIN_ARGS[TRAIN_ARGS.index("--max-context") + 1])
    with start_vllm_server(
        str(REPO / args.model), max_model_len=context, seed=args.seed, log_dir=runs_dir / "vllm-logs"
    ) as server:
        summary["server_start_s"] = round(time.monotonic() - t0, 1)
        for env, steps in [("retool", args.retool_steps), ("math", args.math_steps)]:
            if not healthy(server.url):  # died in the last run (the trainer relaunches only its own)
                print(f"=== the vLLM server died; restarting it (log: {server.log_path})", flush=True)
                server.restart()
                server.wait_healthy(600)
            wall_s = run(env, steps, runs_dir / env, server.url, args)
            lines = load_metrics(runs_dir / env / "metrics.jsonl")
            if not any("eval/accuracy" in m for m in lines):  # e.g. refused at start-up: nothing to show
                sys.exit(f"demo: the {env} run logged no held-out eval: the trainer's output above says why")
            summary["runs"][env] = summarize(lines, wall_s)
            tool = "with" if env == "retool" else "without"
            title = f"--env {env} ({tool} the code interpreter), {args.model}"
            plot(lines, title, out_dir / f"demo_{env}.png")
            if env == "retool":
                viewer_page = write_viewer_page([str(runs_dir / env)])
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    (out_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    # SUMMARY TABLE
    print(f"\nheld-out accuracy and tool-call rate, greedy, {args.eval_limit} problems (before → after)")
    print(f"{'run':<8} {'steps':>5} {'train s':>8} {'accuracy':>15} {'tool-call rate':>15}")
    for env, r in summary["runs"].items():
        acc = f"{r['accuracy_before']:.0%} → {r['accuracy_after']:.0%}"
        tool = f"{r['tool_call_rate_before']:.0%} → {r['tool_call_rate_after']:.0%}"
        print(f"{env:<8} {r['steps']:>5} {r['train_s']:>8.0f} {acc:>15} {tool:>15}")
    print(
        f"total {summary['wall_s']:.0f} s (server start {summary['server_start_s']:.0f} s, runs "
        + ", ".join(f"{env} {r['wall_s']:.0f} s" for env, r in summary["runs"].items())
        + f"); figures and demo_summary.json in {out_dir}"
        + ("" if args.update_docs else " (--update-docs: into docs/, over the committed ones)")
    )
    print(f"the retool run's completions, token by token: {viewer_page.resolve()} (open it in a browser)")
    return summary


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("demo: interrupted; its trainer and vLLM server are stopped")
