"""Plot a run's metrics.jsonl as PNG curves, one figure per key prefix (rollout/, train/, ...).

python scripts/plot_metrics.py runs/latest/metrics.jsonl --out runs/latest/plots
"""

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("metrics", help="metrics.jsonl written by train_async_grpo.py, or the run dir holding it")
parser.add_argument("--out", default=None, help="output directory (default: plots/ beside the metrics file)")
parser.add_argument("--keys", nargs="*", default=None, help="only these keys (default: every numeric key)")


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """The JSON objects with a "step" of a .jsonl file, and the number of lines that were not (a killed
    trainer can leave a cut last line, in completions.jsonl and in metrics.jsonl)."""
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def load(path: Path) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """key -> [(step, value)] (a resumed run's repeated steps keep the last value written), and the
    number of lines that were not JSON rows."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    rows, bad = read_jsonl(path)
    for row in rows:
        for k, v in row.items():
            if k != "step" and isinstance(v, int | float) and math.isfinite(v):
                series[k][row["step"]] = float(v)
    return {k: sorted(v.items()) for k, v in series.items()}, bad


def main(argv: list[str] | None = None) -> list[Path]:
    args = parser.parse_args(argv)
    metrics = Path(args.metrics)
    if metrics.is_dir():  # the run dir, as view_rollouts.py takes it
        metrics = metrics / "metrics.jsonl"
    if not metrics.is_file():
        sys.exit(
            f"plot_metrics: {metrics} not found: give a training run's --output-dir or its metrics.jsonl"
        )
    out = Path(args.out) if args.out else metrics.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    series, bad = load(metrics)
    if bad:
        print(f"plot_metrics: skipped {bad} line(s) of {metrics} that are not JSON rows", file=sys.stderr)
    keys = [k for k in series if args.keys is None or k in args.keys]
    by_prefix: dict[str, list[str]] = defaultdict(list)
    for k in keys:
        by_prefix[k.split("/")[0] if "/" in k else "run"].append(k)
    written = []
    for prefix, ks in sorted(by_prefix.items()):
        cols = min(4, len(ks))
        rows = math.ceil(len(ks) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
        for ax, k in zip(axes.flat, sorted(ks)):
            steps, values = zip(*series[k])
            ax.plot(steps, values, marker="." if len(steps) < 50 else None)
            ax.set_title(k, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(ks) :]:
            ax.axis("off")
        fig.tight_layout()
        path = out / f"{prefix}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    print(f"wrote {len(written)} figures to {out}")
    return written


if __name__ == "__main__":
    main()
