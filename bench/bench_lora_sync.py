"""Adapter-only sync (--lora-rank) beside the full-weight sync of the same model, on one real vLLM server
started with LoRA on, and the decode speed of an unmerged adapter beside the bare base.

    python bench/bench_lora_sync.py [--model models/tiny] [--widen 8] [--rank 8] [--syncs 9]

Each round: one full-weight sync (weight_sync.WeightSyncer, gloo on CPU) of the base, then one adapter
sync as a LoRA run does it (lora.write_adapter → lora.load_adapter of `v{n}` → unload `v{n-1}` and
delete its directory), so the machine's load moves both alike; medians reported. Then the same greedy
completions (`--decode-tokens` each) naming the base and naming the adapter: vLLM decodes an unmerged
adapter with extra LoRA matmuls per layer (TRL measured 1.33-1.39× slower on GPU). `--widen` as in
bench_weight_sync.py (hidden and MLP sizes × N, random weights) so the bytes show. Prints one JSON
object; with --out it is merged into that results file.
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file from anywhere
import lora  # noqa: E402
from bench.bench_weight_sync import widened_model  # noqa: E402
from bench.results import merge_results  # noqa: E402
from vllm_server import served_model_name, start_vllm_server  # noqa: E402
from weight_sync import WeightSyncer  # noqa: E402


def decode_tokens_per_s(url: str, name: str, n_requests: int, tokens: int) -> float:
    """Greedy completions, one after another (no batching: the per-token cost is what differs)."""
    body = {
        "model": name,
        "prompt": [1, 2, 3, 4],
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    for _ in range(n_requests):
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(req, timeout=300).read()
    return n_requests * tokens / (time.monotonic() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny", help="model directory the server and trainer load")
    p.add_argument("--widen", type=int, default=8, help="scale hidden/MLP sizes by this factor (1 = as is)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (every attention and MLP projection)")
    p.add_argument("--syncs", type=int, default=9, help="rounds to time: medians are reported")
    p.add_argument("--decode-tokens", type=int, default=256, help="tokens per timed completion")
    p.add_argument("--out", default=None, help="JSON results file to merge into")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model_dir = widened_model(args.model, args.widen, tmp / "model") if args.widen > 1 else args.model
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    full_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 1e6
    with start_vllm_server(model_dir, lora_rank=args.rank, lora_slots=3, log_dir=tmp) as server:
        syncer = WeightSyncer([server.url], backend="nccl" if torch.cuda.is_available() else "gloo")
        syncer.init()
        model = lora.attach(base, args.rank, 2 * args.rank, lora.DEFAULT_TARGETS, torch.float32)
        root, full, adapter = tmp / "adapters", [], []
        for version in range(1, args.syncs + 1):
            t0 = time.monotonic()
            # The base's own weights, as a full fine-tuning run sends them: without peft's wrapping
            # (`q_proj.base_layer.weight` is `q_proj.weight` to vLLM) and without the adapter.
            weights = [
                (n.replace(".base_layer", ""), p)
                for n, p in model.get_base_model().named_parameters()
                if ".lora_" not in n
            ]
            syncer.sync(weights, version=version)
            full.append(time.monotonic() - t0)
            with torch.no_grad():
                for param in lora.adapter_parameters(model):
                    param.add_(1e-3)  # an optimizer step's worth of change: B ≠ 0
            t0 = time.monotonic()
            path = lora.write_adapter(model, root, version)
            lora.load_adapter(server.url, version, path)
            lora.unload_versions(server.url, {version - 1} if version > 1 else set(), keep_from=version)
            lora.remove_dirs(root, keep_from=version)
            adapter.append(time.monotonic() - t0)
        syncer.close()
        adapter_mb = lora.adapter_bytes(path) / 1e6
        # Alternated, after a warm-up of each (the first requests pay one-off costs), medians of rounds.
        names = {"base": served_model_name(server.url), "adapter": lora.adapter_name(args.syncs)}
        tps = {k: [] for k in names}
        for i in range(7):
            for k, name in names.items():
                rate = decode_tokens_per_s(server.url, name, 1, args.decode_tokens)
                if i > 0:
                    tps[k].append(rate)
        base_tps, lora_tps = (statistics.median(tps[k]) for k in names)
    shutil.rmtree(tmp, ignore_errors=True)

    full_s, adapter_s = statistics.median(full), statistics.median(adapter)
    result = {
        f"lora_sync_widen{args.widen}": {
            "model": args.model,
            "widen": args.widen,
            "rank": args.rank,
            "full_mb": round(full_mb, 2),
            "adapter_mb": round(adapter_mb, 3),
            "adapter_over_full_bytes": round(adapter_mb / full_mb, 4),
            "full_sync_seconds": round(full_s, 4),
            "adapter_sync_seconds": round(adapter_s, 4),  # write + load + unload the previous
            "decode_tokens_per_s_base": round(base_tps, 1),
            "decode_tokens_per_s_adapter": round(lora_tps, 1),
            "decode_slowdown": round(base_tps / lora_tps, 2),
            "settings": f"medians of {args.syncs} rounds of full sync, adapter sync; one LoRA-enabled "
            f"server (--max-lora-rank {lora.vllm_max_lora_rank(args.rank)}); decode: medians of 6 greedy "
            f"completions of {args.decode_tokens} tokens each, base and adapter alternated",
            "command": "python bench/bench_lora_sync.py " + " ".join(sys.argv[1:]),
        }
    }
    print(json.dumps(result, indent=1))
    if args.out:
        merge_results(args.out, result)


if __name__ == "__main__":
    main()
