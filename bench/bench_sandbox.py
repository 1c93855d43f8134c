"""Sandbox latency: p50 and p99 wall time of `print(1)` over N sequential calls.

.venv/bin/python bench/bench_sandbox.py --n 50
"""

import argparse
import asyncio
import statistics
import sys

sys.path.insert(0, ".")
from envs.sandbox import isolation_mode, run_python  # noqa: E402


async def bench(n: int) -> list[float]:
    times = []
    for _ in range(n):
        r = await run_python("print(1)", timeout_s=10)
        assert r.output == "1\n", r
        times.append(r.duration_s)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=50, help="number of calls")
    args = parser.parse_args()
    t = sorted(asyncio.run(bench(args.n)))
    p99 = t[min(len(t) - 1, int(0.99 * len(t)))]
    print(
        f"sandbox print(1) [{isolation_mode()}]: n={args.n} p50={statistics.median(t) * 1000:.0f} ms "
        f"p99={p99 * 1000:.0f} ms max={t[-1] * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
