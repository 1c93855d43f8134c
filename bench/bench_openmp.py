"""The trainer's step time on CPU with OpenMP threads that spin at barriers for a while (OpenMP's
default, no OMP_WAIT_POLICY) or sleep at once (`OMP_WAIT_POLICY=PASSIVE`, what train_async_grpo.py sets
before torch loads), alone and while a vLLM server on the same cores generates (as in every CPU run:
tests, the demo).

    python bench/bench_openmp.py [--repeats 1] [--out bench/results.json]

One real server on tiny-warm; each measurement is a fresh process (the policy is read when torch loads
OpenMP) timing train_step on 8 random sequences of 300 tokens (the second step; the first warms up: a
spinning step beside the server takes about a minute), the busy case with a
thread that keeps 8 completions of 200 tokens in flight on the server. Policies alternate, so load from
elsewhere falls on both; medians over --repeats. Prints one JSON object; with --out it is merged in.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a file from anywhere
from bench.results import merge_results  # noqa: E402
from vllm_server import start_vllm_server  # noqa: E402

MODEL = str(REPO / "models" / "tiny-warm")

# One measurement, in a process of its own: argv = server url, "busy" or "alone".
STEP = """
import json, sys, threading, time, urllib.request
from types import SimpleNamespace
import torch
from transformers import AutoModelForCausalLM
from trainer import train_step
url, busy, model_path = sys.argv[1], sys.argv[2] == "busy", sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
gen = torch.Generator().manual_seed(0)
seqs = [{"ids": torch.randint(0, 500, (300,), generator=gen).tolist(), "mask": [0] * 150 + [1] * 150,
         "behaviour": [-2.0] * 300, "advantage": 1.0 if i % 2 else -1.0} for i in range(8)]
args = SimpleNamespace(micro_batch_tokens=4096, temperature=1.0, top_p=1.0, top_k=0, eps_low=0.2,
    eps_high=0.28, is_cap=2.0, loss_norm="token", kl_beta=0.0, max_grad_norm=1.0, mini_batches=1,
    compute_dtype="fp32")
opt = torch.optim.AdamW(model.parameters(), lr=0.0)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
done = threading.Event()
def generate():
    body = json.dumps({"model": model_path, "prompt": [1, 2, 3, 4], "max_tokens": 200, "ignore_eos": True,
                       "n": 8}).encode()
    while not done.is_set():
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req).read()
if busy:
    threading.Thread(target=generate, daemon=True).start()
times = []
for _ in range(2):
    t0 = time.perf_counter()
    train_step(model, None, opt, sched, seqs, args, 0, 1, torch.device("cpu"))
    times.append(time.perf_counter() - t0)
done.set()
print(times[-1])
"""


def step_seconds(url: str, policy: str, load: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", STEP, url, load, MODEL], env=env, capture_output=True, text=True, timeout=1800
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()
    times: dict[str, list[float]] = {}
    server = start_vllm_server(MODEL, log_dir="runs/bench-openmp-logs", timeout_s=600)
    try:
        for _ in range(args.repeats):
            for load in ("alone", "busy"):
                for policy in ("default", "PASSIVE"):
                    times.setdefault(f"{policy}_{load}", []).append(step_seconds(server.url, policy, load))
    finally:
        server.stop()
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}
    result = {
        "openmp_wait_policy": {
            "step_s": med,
            "spinning_over_passive_alone": round(med["default_alone"] / med["PASSIVE_alone"], 2),
            "spinning_over_passive_busy": round(med["default_busy"] / med["PASSIVE_busy"], 2),
            "command": "python bench/bench_openmp.py",
            "settings": {"repeats": args.repeats, "sequences": 8, "tokens": 300},
        }
    }
    print(json.dumps(result))
    if args.out:
        merge_results(args.out, result)


if __name__ == "__main__":
    main()
