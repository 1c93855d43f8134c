"""The step guard (trainer.train_step, train_async_grpo's loop): a non-finite loss or gradient is never
applied (weights and AdamW state untouched), nothing is synced, the step is counted and named once on
stderr, and --max-nonfinite-steps in a row stop the run with a checkpoint of the last finite weights.

The fault is real, not a mock: a NaN written into one weight of the model on disk that only the
trainer's step reaches, the frozen reference model of --kl-beta (loaded from --model; the policy comes
from the checkpoint the run resumes from, and the server holds the policy's weights): the KL term, and so
the loss and every gradient, are NaN while rollouts and the fidelity probe are healthy."""

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import trainer as T
from checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parent.parent
NAN_AT = "model.layers.1.mlp.down_proj.weight"


def _args(**kw) -> SimpleNamespace:
    args = dict(
        micro_batch_tokens=64, temperature=1.0, top_p=1.0, top_k=0, eps_low=0.2, eps_high=0.28, is_cap=2.0,
        loss_norm="token", kl_beta=0.1, max_grad_norm=1.0, mini_batches=1, compute_dtype="fp32",
    )  # fmt: skip
    return SimpleNamespace(**(args | kw))


def _seqs() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for k, (p, c) in enumerate([(5, 9), (3, 4), (7, 12), (4, 6)]):
        seqs.append({
            "ids": torch.randint(0, 500, (p + c,), generator=gen).tolist(), "mask": [0] * p + [1] * c,
            "behaviour": [-2.0] * (p + c), "advantage": [1.0, -0.5, 0.7, -1.2][k],
        })  # fmt: skip
    return seqs


def _nan_model(src: Path, dst: Path) -> Path:
    """A copy of `src` with one NaN in NAN_AT: a corrupt checkpoint on disk."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights[NAN_AT][0, 0] = float("nan")
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_nonfinite_loss_leaves_weights_and_adamw_state_untouched(tiny_model, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(_nan_model(tiny_model, tmp_path / "nan"), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    cpu = torch.device("cpu")
    # One finite step first (the reference is the policy itself), so AdamW has state to protect.
    T.train_step(model, model, optimizer, scheduler, _seqs(), _args(), 0, 1, cpu)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()}
    metrics = T.train_step(model, ref, optimizer, scheduler, _seqs(), _args(), 0, 1, cpu)
    assert "loss nan" in metrics["nonfinite"] and "grad norm nan" in metrics["nonfinite"], metrics[
        "nonfinite"
    ]
    assert "(first at model." in metrics["nonfinite"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), f"{k} changed by a non-finite step"
    for p in model.parameters():
        for k, v in optimizer.state[p].items():
            assert torch.equal(v, state[id(p)][k]), f"AdamW's {k} absorbed a non-finite step"
    assert all(p.grad is None for p in model.parameters())  # zeroed: nothing left for the next step
    # With two mini-batches the first is non-finite: no optimizer step ran, and the metrics say so.
    two = T.train_step(model, ref, optimizer, scheduler, _seqs(), _args(mini_batches=2), 0, 1, cpu)
    assert two["nonfinite"].startswith("mini-batch 1/2: loss nan") and two["train/optimizer_steps"] == 0.0
    # And the next finite step trains as usual.
    assert T.train_step(model, model, optimizer, scheduler, _seqs(), _args(), 0, 1, cpu)["nonfinite"] == ""
    assert not torch.equal(model.state_dict()[NAN_AT], weights[NAN_AT])


def test_nonfinite_weights_after_the_step_stop_the_run_naming_the_parameter(tiny_model):
    """A NaN in an embedding row no token of the batch uses: the loss and gradients are finite, the
    step is taken, and the check after it names the parameter (rather than letting it be synced)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[550, 3] = float("nan")  # _seqs draws ids below 500
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(
        T.NonFiniteWeights, match=r"model\.embed_tokens\.weight is non-finite after the AdamW"
    ):
        T.train_step(
            model, None, optimizer, scheduler, _seqs(), _args(kl_beta=0.0), 0, 1, torch.device("cpu")
        )


def _resume_point(model_dir: Path, out: Path) -> Path:
    """A step-0 checkpoint of `model_dir` (the run resumes its policy from here): what a run saves."""
    from train_async_grpo import parser
    from trainer import make_optimizer

    args = parser.parse_args(["--model", str(model_dir)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer, scheduler = make_optimizer(model, args)
    state = {"step": 0, "model_version": 0, "dataset_position": 0, "args": vars(args)}
    return save_checkpoint(out, model, AutoTokenizer.from_pretrained(model_dir), optimizer, scheduler, state)


@pytest.mark.timeout(900)
def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def test_nonfinite_steps_are_not_applied_nor_synced_and_k_in_a_row_stop_the_run(
    served_model, trainer_server, tmp_path
):
    nan_model = _nan_model(served_model, tmp_path / "nan-model")
    ckpt = _resume_point(served_model, tmp_path / "seed-run")
    out = tmp_path / "run"
    cmd = [
        sys.executable, str(REPO / "train_async_grpo.py"), "--model", str(nan_model), "--env", "retool",
        "--resume", str(ckpt), "--kl-beta", "0.1", "--vllm-url", trainer_server.url, "--output-dir", str(out),
        "--max-steps", "5", "--max-nonfinite-steps", "2", "--prompts-per-step", "1",
        "--num-generations", "2", "--max-context", "512", "--max-turns", "2", "--keep-zero-variance",
        "--sandbox-workers", "2", "--batch-timeout", "300", "--unsafe-sandbox",
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=800)
    with urllib.request.urlopen(trainer_server.url + "/weight_info", timeout=10) as r:
        served_version = json.loads(r.read())["weight_version"]
    assert p.returncode == 1, p.stderr[-3000:]
    named = [x for x in p.stderr.splitlines() if "non-finite loss nan" in x and "update not applied" in x]
    assert len(named) == 2 and "(first at model." in named[0], p.stderr[-3000:]
    stops = [
        x for x in p.stderr.splitlines() if x.startswith("stopping at step 2: 2 non-finite steps in a row")
    ]
    assert len(stops) == 1 and "checkpoint of the last finite weights" in stops[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    lines = [json.loads(x, parse_constant=_refuse) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["train/nonfinite_steps"] for x in lines] == [1.0, 2.0]
    assert [x["train/loss"] for x in lines] == [None, None]  # strict JSON: it was written bare NaN
    assert all(x["model_version"] == 0 and x["sync/mb"] == 0.0 for x in lines)
    assert served_version == "0", "a non-finite step was synced"  # the start-up sync's tag, no other
    saved = out / "checkpoints" / "step_000002" / "model.safetensors"
    before, after = load_file(ckpt / "model.safetensors"), load_file(saved)
    assert all(torch.equal(before[k], after[k]) for k in before), "the weights moved"


def test_the_limit_counts_non_finite_steps_in_a_row_not_all_of_them(capsys):
    """--max-nonfinite-steps 2: isolated non-finite steps, however many, never stop the run; two in a row
    do. Each is counted (train/nonfinite_steps) and named once."""
    count = T.NonFiniteCount()
    steps = ["loss nan", "", "loss nan", "", "grad norm inf", ""]
    assert [count.record(what, k + 1, limit=2) for k, what in enumerate(steps)] == [False] * 6
    assert (count.total, count.in_row) == (3, 0)
    assert count.record("loss nan", 7, limit=2) is False and count.record("loss nan", 8, limit=2) is True
    assert count.total == 5 and capsys.readouterr().err.count("update not applied") == 5
    assert T.NonFiniteCount().record("loss nan", 1, limit=0) is True  # 0: the first stops the run
