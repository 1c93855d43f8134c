"""Sandbox latency and throughput: the warm path (fork server) beside the cold path (a fresh process
per call), and the cold path beside a bare `python -I` subprocess doing the same work.

    python bench/bench_sandbox.py [--n 40] [--cap 8] [--out bench/results.json]

1. p50/p90/max wall time of `print(1)` and of `import numpy`, sequential cold calls, alternating with a bare
   `python -I -c CODE` subprocess (no isolation, no fresh directory), so the ratio is the sandbox's cost
   over the interpreter's own start-up, the floor.
2. p50 of `import numpy as np; print(np.arange(3).sum())`, warm and cold calls alternating.
3. calls/s of `print(1)` through one `Sandbox(max_concurrency=cap)` (the trainer's --sandbox-workers),
   warm and cold, beside the same number of bare subprocesses at the same concurrency.
Prints one JSON object; with --out it is merged into that results file.
"""

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
from bench.results import merge_results  # noqa: E402
from envs.sandbox import Sandbox, isolation_mode, run_python  # noqa: E402

NUMPY_SNIPPET = "import numpy as np; print(np.arange(3).sum())"


async def bare_python(code: str) -> float:
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    await proc.communicate()
    assert proc.returncode == 0
    return time.monotonic() - t0


async def sandboxed(code: str) -> float:
    r = await run_python(code, timeout_s=30)
    assert r.exit_code == 0, r
    return r.duration_s


def percentiles_ms(times: list[float], prefix: str = "", digits: int | None = None) -> dict[str, float]:
    """p50, p90 and max in ms. Nearest-rank p90: of 40 calls the 36th; a p99 of under 100 calls is only
    the max."""
    t = sorted(times)
    ranked = {"p50": statistics.median(t), "p90": t[math.ceil(0.9 * len(t)) - 1], "max": t[-1]}
    return {f"{prefix}{name}_ms": round(v * 1000, digits) for name, v in ranked.items()}


async def latency(code: str, n: int) -> dict:
    ours, bare = [], []
    for _ in range(n):  # alternate, so drift in a shared machine hits both alike
        ours.append(await sandboxed(code))
        bare.append(await bare_python(code))
    return {
        **percentiles_ms(ours),
        **percentiles_ms(bare, "bare_"),
        "p50_over_bare": round(statistics.median(ours) / statistics.median(bare), 2),
    }


async def warm_vs_cold(n: int) -> dict:
    warm, cold = Sandbox(max_concurrency=1), Sandbox(max_concurrency=1, warm=False)
    await warm.run("print(1)")  # start the fork server (numpy and sympy imports) outside the timing
    w, c = [], []
    for _ in range(n):  # alternate, so drift in a shared machine hits both alike
        for sandbox, times in ((warm, w), (cold, c)):
            r = await sandbox.run(NUMPY_SNIPPET, timeout_s=30)
            assert r.output == "3\n", r
            times.append(r.duration_s)
    warm.close()
    return {
        **percentiles_ms(w, "warm_", 1),
        **percentiles_ms(c, "cold_", 1),
        "warm_over_cold": round(statistics.median(w) / statistics.median(c), 3),
    }


async def sandbox_calls_per_s(n: int, cap: int, warm: bool) -> float:
    sandbox = Sandbox(max_concurrency=cap, warm=warm)
    await sandbox.run("print(1)")  # the fork server starts outside the timing
    t0 = time.monotonic()
    results = await asyncio.gather(*(sandbox.run("print(1)", timeout_s=30) for _ in range(n)))
    calls_per_s = n / (time.monotonic() - t0)
    assert all(r.output == "1\n" for r in results), [r for r in results if r.output != "1\n"][:1]
    sandbox.close()
    return calls_per_s


async def calls_per_s(n: int, cap: int) -> tuple[float, float, float]:
    """(warm, cold, bare) calls/s at concurrency `cap`."""
    warm = await sandbox_calls_per_s(n, cap, warm=True)
    ours = await sandbox_calls_per_s(n, cap, warm=False)
    sem = asyncio.Semaphore(cap)

    async def one():
        async with sem:
            await bare_python("print(1)")

    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(n)))
    return warm, ours, n / (time.monotonic() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=40, help="calls per latency measurement")
    p.add_argument("--cap", type=int, default=8, help="concurrency cap (the trainer's --sandbox-workers)")
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()
    asyncio.run(latency("print(1)", 2))  # warm-up: isolation probe, page cache
    warm, ours, bare = asyncio.run(calls_per_s(4 * args.n, args.cap))
    command = "python bench/bench_sandbox.py " + " ".join(sys.argv[1:])
    result = {
        "sandbox": {
            "print1": asyncio.run(latency("print(1)", args.n)),
            "numpy_import": asyncio.run(latency("import numpy", args.n)),
            "calls_per_s_at_cap": round(ours, 1),
            "bare_calls_per_s_at_cap": round(bare, 1),
            "calls_per_s_over_bare": round(ours / bare, 2),
            "numpy_snippet": asyncio.run(warm_vs_cold(args.n)),
            "warm_calls_per_s_at_cap": round(warm, 1),
            "warm_over_cold_calls_per_s": round(warm / ours, 2),
            "settings": f"isolation {isolation_mode()}, {args.n} sequential calls per latency (cold unless "
            "named warm), "
            f"{4 * args.n} print(1) calls at concurrency {args.cap}",
            "command": command,
        }
    }
    print(json.dumps(result, indent=2))
    if args.out:
        merge_results(args.out, result)


if __name__ == "__main__":
    main()
