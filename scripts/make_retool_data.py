"""Write the small offline retool task set: data/retool_train.jsonl and data/retool_test.jsonl.

    .venv/bin/python scripts/make_retool_data.py            # 2000 train / 200 test, seed 0

Problems whose answers need exact computation, in short templated questions. Most are 4-digit x 3-digit
products (a tiny model can learn to hand these to the interpreter); the rest are modular powers and sums
over ranges. Deterministic for a given seed; no question appears in both splits.
"""

import argparse
import json
import os
import random


def product(rng: random.Random) -> dict:
    a, b = rng.randint(1000, 9999), rng.randint(100, 999)
    return {"question": f"What is {a} * {b}?", "answer": str(a * b), "kind": "product"}


def power_mod(rng: random.Random) -> dict:
    a, b, m = rng.randint(2, 99), rng.randint(10, 999), rng.randint(7, 9999)
    return {
        "question": f"What is {a}^{b} mod {m}?",
        "answer": str(pow(a, b, m)),
        "kind": "power_mod",
    }


def range_sum(rng: random.Random) -> dict:
    lo = rng.randint(1, 500)
    hi = lo + rng.randint(50, 5000)
    if rng.random() < 0.5:
        q, ans = (
            f"What is the sum of the integers from {lo} to {hi}?",
            sum(range(lo, hi + 1)),
        )
    else:
        q = f"What is the sum of the squares of the integers from {lo} to {hi}?"
        ans = sum(i * i for i in range(lo, hi + 1))
    return {"question": q, "answer": str(ans), "kind": "range_sum"}


KINDS = [(product, 0.7), (power_mod, 0.15), (range_sum, 0.15)]


def make_rows(n: int, rng: random.Random, seen: set[str]) -> list[dict]:
    rows = []
    while len(rows) < n:
        make = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
        row = make(rng)
        if row["question"] not in seen:  # no duplicates, and none across splits
            seen.add(row["question"])
            rows.append(row)
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="data", help="where the two .jsonl files go")
    parser.add_argument("--n-train", type=int, default=2000, help="training problems")
    parser.add_argument("--n-test", type=int, default=200, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same files")
    args = parser.parse_args()
    rng, seen = random.Random(args.seed), set()
    train = make_rows(args.n_train, rng, seen)
    test = make_rows(args.n_test, rng, seen)
    os.makedirs(args.out_dir, exist_ok=True)
    write_jsonl(os.path.join(args.out_dir, "retool_train.jsonl"), train)
    write_jsonl(os.path.join(args.out_dir, "retool_test.jsonl"), test)
    print(f"wrote {len(train)} train and {len(test)} test rows to {args.out_dir}/")


if __name__ == "__main__":
    main()
