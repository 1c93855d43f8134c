"""scripts/gpu_check.py (`make gpu-check`, written for a GPU box without vLLM) runs its checks on the CPU
too: every check passes (2 FSDP ranks over gloo stand for the 2-GPU check) and vLLM is never imported."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(900)
def test_gpu_check_runs_on_the_cpu():
    script = REPO / "scripts" / "gpu_check.py"
    cmd = [sys.executable, str(script), "--device", "cpu", "--small", "--steps", "1"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith(("PASS", "FAIL"))]
    assert len(lines) == 8 and all(x.startswith("PASS") for x in lines), r.stdout
    # The bf16 truncation check (nucleus-edge tokens: 7 of 84 got −inf and a nan loss before the trainer
    # kept sampled tokens in its kept set) and 2 FSDP ranks over gloo.
    assert any(x.startswith("PASS  top-k 50 / top-p 0.9 in bf16: 0 of ") for x in lines), r.stdout
    assert any(x.startswith("PASS  FSDP2 over 2 ranks (gloo)") for x in lines), r.stdout
    assert "8/8 checks passed; vLLM not imported" in r.stdout


def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_truncation_check_takes_the_gpu_shapes_sequences():
    """Check 5 on the sequences of the GPU shapes (200-token prompts, 300-token completions; the model is
    the small one, so it runs here): it once cut every sequence to 40 tokens, inside the prompt, and
    crashed on the GPU (`mask.index(1)`: no completion left; `behaviour` left at full length)."""
    from transformers import Qwen2Config

    gpu_check = load_gpu_check()
    config = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
    )  # fmt: skip
    seqs = gpu_check.make_seqs(4, 200, 300, 512)  # main()'s GPU shapes
    gpu_check.check_truncation(config, torch.device("cpu"), seqs, 4096)
    assert gpu_check.RESULTS == [True]
