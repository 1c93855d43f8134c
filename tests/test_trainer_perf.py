"""The trainer's step at the hardware's pace: no device→host sync inside a step (metrics add up on the
device and are read once per optimizer step), and gradient checkpointing only where memory needs it.
Speed and memory figures are bench/bench_trainer.py's, not asserted here."""

import inspect
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

import sampling
import train_async_grpo as script
import trainer as T
from batches import packed_attention
from trainer import activation_bytes, choose_checkpointing

REPO = Path(__file__).resolve().parent.parent
# Every Tensor method that hands a device value to the host: on CUDA each waits for the GPU to drain.
HOST_READS = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy"]


def _seqs(n: int, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        p, c = 4 + k % 3, 6 + (3 * k) % 7
        out.append({
            "ids": torch.randint(0, 500, (p + c,), generator=gen).tolist(),
            "mask": [0] * p + [1] * c,
            "behaviour": [0.0] * p + [-2.0] * c,
            "advantage": 1.0 if k % 2 else -0.5,
        })  # fmt: skip
    return out


def _step(model_dir: Path, device: torch.device, flags: list[str], ref: bool = False):
    """A closure running one train_step on 10 sequences in 24-token micro-batches (several per
    optimizer step) with the real parser's defaults and `flags`."""
    args = script.parser.parse_args(["--model", "m", "--micro-batch-tokens", "24", *flags])
    args.compute_dtype = args.compute_dtype or "fp32"
    torch.manual_seed(0)
    attn = packed_attention(device, args.compute_dtype)  # the trainer's (sdpa would build a packed mask)
    load = lambda: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        model_dir, dtype=torch.float32, attn_implementation=attn
    ).to(device)
    model = load()
    ref_model = load() if ref else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    seqs = _seqs(10)
    return lambda: T.train_step(model, ref_model, optimizer, scheduler, seqs, args, 0, 1, device)


def count_host_reads(monkeypatch, run) -> list[str]:
    """The host reads the project's own code asks for while `run()` runs (on CPU they cost nothing, on
    CUDA each is a sync): every HOST_READS call whose caller is a file of this repository, not torch's
    or transformers' internals (their CPU-side bookkeeping, e.g. AdamW's step count, is no device
    read). Returns 'file:line method' per call."""
    seen = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, __original=original, __name=name, **k):
            caller = inspect.currentframe().f_back
            path = Path(caller.f_code.co_filename)
            if REPO in path.parents and ".venv" not in path.parts and "tests" not in path.parts:
                seen.append(f"{path.name}:{caller.f_lineno} {__name}")
            return __original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run()
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize(
    "flags, ref, steps",
    [([], False, 1), (["--mini-batches", "2", "--loss-norm", "sequence", "--kl-beta", "0.1"], True, 2)],
    ids=["one-step", "two-mini-batches-sequence-norm-kl"],
)
def test_a_step_reads_the_device_twice_per_optimizer_step(monkeypatch, tiny_model, flags, ref, steps):
    """The minimum: per optimizer step one read of the metrics, loss and gradient norm together (the
    guard decides on them before the step) and one of the weights' finiteness after it. Before: ~10 per
    micro-batch (loss.item() and every metric's), the sequence lengths in every forward, the sequence
    count of the sequence norm."""
    step = _step(tiny_model, torch.device("cpu"), flags, ref)
    reads = count_host_reads(monkeypatch, step)
    assert len(reads) == 2 * steps, reads
    assert sorted({r.split(":")[0] for r in reads}) == ["trainer.py"], reads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.set_sync_debug_mode)")
def test_a_step_synchronizes_with_the_gpu_twice_per_optimizer_step(tiny_model):
    """On CUDA the driver counts: torch's sync debug mode warns at every synchronizing call (a D2H
    copy, .item(), nonzero, a blocking H2D copy). A warm-up step first: the first one allocates and
    initialises what later ones reuse (AdamW's state)."""
    step = _step(tiny_model, torch.device("cuda"), ["--compute-dtype", "bf16"])
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 2, syncs


# ---------------------------------------------------------------------------------------------------
# --gradient-checkpointing auto: from the model, the micro-batch and the free memory
# ---------------------------------------------------------------------------------------------------
QWEN_1_5B = SimpleNamespace(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
GIB = 2**30


def test_checkpointing_on_and_off_are_obeyed():
    for setting, on in [("on", True), ("off", False)]:
        chosen, why = choose_checkpointing(setting, QWEN_1_5B, 1_540_000_000, 16384, 1, True, GIB)
        assert chosen is on and why == f"--gradient-checkpointing {setting}"


def test_auto_checkpointing_turns_on_only_where_the_activations_do_not_fit():
    """Qwen2.5-1.5B on an 80 GB H100 (~75 GiB free with the fp32 weights loaded): 8k-token micro-batches
    fit without checkpointing (issue 38 measured 57 GiB peak), 16k do not; two FSDP ranks shard the
    gradients and AdamW state; a CPU with unknown free memory never turns it on."""
    n = 1_540_000_000
    assert activation_bytes(QWEN_1_5B, 8192, bf16=True) == pytest.approx(30.3 * 2**30, rel=0.01)
    off, why = choose_checkpointing("auto", QWEN_1_5B, n, 8192, 1, True, 75 * GIB)
    assert not off and "fit in 85% of the 75.0 GiB free" in why and "8192-token" in why
    on, why = choose_checkpointing("auto", QWEN_1_5B, n, 16384, 1, True, 75 * GIB)
    assert on and "exceed" in why
    assert not choose_checkpointing("auto", QWEN_1_5B, n, 16384, 8, True, 75 * GIB)[0]  # state sharded
    assert choose_checkpointing("auto", QWEN_1_5B, n, 8192, 1, False, 75 * GIB)[0]  # fp32: twice the bytes
    chosen, why = choose_checkpointing("auto", QWEN_1_5B, n, 8192, 1, True, None)
    assert not chosen and "free memory unknown" in why


def test_the_trainer_says_what_it_chose_and_why(tiny_model, capsys):
    args = SimpleNamespace(
        model=str(tiny_model), kl_beta=0.0, compute_dtype="fp32", micro_batch_tokens=4096, max_context=2048
    )
    for setting, on in [("auto", False), ("on", True)]:
        args.gradient_checkpointing = setting
        model, _, _ = T.load_models(args, None, torch.device("cpu"), world_size=1)
        assert model.is_gradient_checkpointing is on
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("gradient checkpointing"))
        assert line.startswith(f"gradient checkpointing: {'on' if on else 'off'} (")
        assert ("free" in line) if setting == "auto" else ("--gradient-checkpointing on" in line)


def test_auto_checkpointing_charges_lora_for_its_adapter_alone(tiny_model, monkeypatch, capsys):
    """Gradients and AdamW state exist for the trained parameters only: with --lora-rank the adapter,
    not the frozen base (7B with a rank-16 adapter: 0.5 GiB, where all parameters would be 86 GiB and
    turn checkpointing on for nothing). The free memory is set between the two: LoRA fits without
    checkpointing, full fine-tuning of the same model does not, and the line counts what it charged."""
    args = script.parser.parse_args(["--model", str(tiny_model), "--lora-rank", "8", "--compile", "off"])
    args.compute_dtype = "fp32"
    model, _, _ = T.load_models(args, None, torch.device("cpu"), world_size=1)
    capsys.readouterr()
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert adapter < everything / 10
    acts = activation_bytes(model.config, args.micro_batch_tokens, bf16=False)
    free = (acts + 12 * (adapter + everything) / 2) / T.CHECKPOINT_HEADROOM
    monkeypatch.setattr(T, "free_memory", lambda device, taken_later=0.0: int(free))
    for lora_rank, on, trained in [(8, False, adapter), (0, True, everything)]:
        args.lora_rank = lora_rank
        model, _, _ = T.load_models(args, None, torch.device("cpu"), world_size=1)
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("gradient checkpointing"))
        assert model.is_gradient_checkpointing is on, line
        assert f"AdamW state for {trained / 1e6:.1f}M trainable parameters" in line, line


# ---------------------------------------------------------------------------------------------------
# --mini-batches: a batch smaller than N, and a non-finite mini-batch after applied ones
# ---------------------------------------------------------------------------------------------------
def _trained(model_dir: Path, seqs: list[dict], mini_batches: int):
    """(metrics, model, optimizer) after one train_step on `seqs` from the tiny model's weights, with
    AdamW and the real parser's defaults."""
    args = script.parser.parse_args(
        ["--model", "m", "--micro-batch-tokens", "24", "--mini-batches", str(mini_batches)]
    )
    args.compute_dtype = "fp32"
    cpu = torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=packed_attention(cpu, "fp32")
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return T.train_step(model, None, optimizer, scheduler, seqs, args, 0, 1, cpu), model, optimizer


def test_a_batch_with_fewer_sequences_than_mini_batches_trains_one_per_sequence(tiny_model):
    """The fidelity check can drop groups after the batch was sized (--prompts-per-step 2
    --num-generations 2 --mini-batches 4, one group dropped: 2 sequences). --mini-batches 4 over 3
    sequences is the step --mini-batches 3 takes, each sequence its own mini-batch (it crashed on an
    empty one)."""
    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    four, model4, _ = _trained(tiny_model, _seqs(3), mini_batches=4)
    three, model3, _ = _trained(tiny_model, _seqs(3), mini_batches=3)
    assert four["nonfinite"] == "" and four["train/optimizer_steps"] == 3.0
    assert four["train/loss"] == three["train/loss"]
    for k, v in model3.state_dict().items():
        assert torch.equal(model4.state_dict()[k], v), k
    assert not torch.equal(model4.state_dict()["lm_head.weight"], start["lm_head.weight"])


def test_a_non_finite_mini_batch_after_applied_ones_keeps_them_and_says_they_are_synced(tiny_model, capsys):
    """--mini-batches 2 with a NaN behaviour logprob in the second: the first was applied before the
    second was scored (its gradient needs the weights the first moved, so it cannot be checked first).
    The step reports it (train/optimizer_steps 1, the weights and AdamW state those of the first
    mini-batch's step alone), and the stderr line says it is applied and synced, not 'nothing synced':
    the loop syncs such a step, or the servers would sample from weights the trainer no longer has."""
    seqs = _seqs(4)
    for s in seqs[2:]:
        s["behaviour"] = [float("nan")] * len(s["ids"])
    partial, model, optimizer = _trained(tiny_model, seqs, mini_batches=2)
    assert partial["nonfinite"].startswith("mini-batch 2/2: loss nan"), partial["nonfinite"]
    assert partial["train/optimizer_steps"] == 1.0
    _, first_alone, first_optimizer = _trained(tiny_model, seqs[:2], mini_batches=1)
    for k, v in first_alone.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for p, q in zip(model.parameters(), first_alone.parameters()):
        for k, v in first_optimizer.state[q].items():
            assert torch.equal(optimizer.state[p][k], v), k
    count = T.NonFiniteCount()
    count.record(partial["nonfinite"], 5, limit=3, applied=int(partial["train/optimizer_steps"]))
    err = capsys.readouterr().err
    assert "mini-batch 2/2: loss nan" in err and "; mini-batch 1 applied and synced" in err, err
    assert "not applied, nothing synced" not in err and "(1 in a row" in err, err
    count.record("mini-batch 4/4: loss nan", 6, limit=3, applied=3)
    assert "; mini-batches 1-3 applied and synced" in capsys.readouterr().err
    count.record("mini-batch 1/4: loss nan", 7, limit=3, applied=0)
    assert "; update not applied, nothing synced (3 in a row" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# --compile: each decoder layer through torch.compile; the same step, one compile for every packing
# ---------------------------------------------------------------------------------------------------
def test_compile_auto_is_on_where_measured_to_pay_and_the_line_says_so(capsys, head_restored):
    for setting, device, on, why in [
        (
            "auto",
            "cpu",
            False,
            "auto: off on cpu, where inductor's ~20 s at start-up outweighs a short run's gain",
        ),
        (
            "auto",
            "cuda",
            True,
            "auto: on CUDA, 1.21x the step in make bench-gpu; --compile off to skip inductor's ~20 s",
        ),
        ("on", "cpu", True, "--compile on"),
        ("off", "cuda", False, "--compile off"),
    ]:
        line = T.compile_model(setting, torch.device(device))  # no model: only the choice
        assert line == f"compiled decoder layers and logprob head: {'on' if on else 'off'} ({why})"
        assert capsys.readouterr().out == line + "\n"


def _rms_norm_in_the_input_dtype(self, hidden: torch.Tensor) -> torch.Tensor:
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.slow
def test_compiled_layers_take_the_eager_step_and_compile_once(tiny_model, monkeypatch, head_restored):
    """Three train steps on batches packed three ways (other row lengths, more sequences per row),
    in float64 (inductor's C++ kernels have it), eager against compiled with gradient checkpointing on
    (its recompute calls the compiled forward), SGD steps (linear in the gradient): the same weights to
    float64 rounding (~1e-16 per operation, reordered by inductor's fusions; 1e-10 is far above it and
    far below the float32 rounding of 1e-7), so a compiled graph that drops, adds or rounds anything
    fails here (the logprob head's too: it is compiled with them). The compiles are
    counted: every graph is made by the first step, none by the two new packings (dynamic shapes; the
    attention, which loops over the row's host-side lengths, is kept out of the graph), and the layers
    share them (two layers, not twice the graphs of one)."""
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    # Qwen2's RMSNorm takes its mean square in float32 whatever the weights' dtype; inductor sums it in
    # another order, so the two steps would differ by float32 rounding (~1e-7), not float64's. Both run
    # the norm in float64 here: what is compared is the compiled graph, not the norm's chosen precision.
    monkeypatch.setattr(Qwen2RMSNorm, "forward", _rms_norm_in_the_input_dtype)
    args = script.parser.parse_args(["--model", "m", "--micro-batch-tokens", "24"])
    args.compute_dtype = "fp32"
    attn = T.packed_attention(torch.device("cpu"), "fp32")
    weights = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model, dtype=torch.float64, attn_implementation=attn
        )
        if compiled:
            model.gradient_checkpointing_enable()
            assert T.compile_model("on", torch.device("cpu"), model).endswith("on (--compile on)")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # linear in the gradient (AdamW is not)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        graphs, recompiles = [], []
        for n, budget in [(10, 24), (7, 40), (12, 64)]:  # rows of 1-2, then 2-3, then 4 sequences
            args.micro_batch_tokens = budget
            T.train_step(model, None, optimizer, scheduler, _seqs(n, seed=n), args, 0, 1, torch.device("cpu"))
            graphs.append(counters["stats"]["unique_graphs"])
            recompiles.append(sum(len(reasons) for reasons in guard_failures.values()))
        weights.append({k: p.detach().clone() for k, p in model.named_parameters()})
    start = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).state_dict()
    assert max((weights[1][k] - start[k]).abs().max().item() for k in weights[1]) > 1e-4  # they moved
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-10, atol=1e-12, msg=k)
    print(f"compiled graphs after each step: {graphs}, recompiles: {recompiles}")
    assert recompiles[0] == recompiles[1] == recompiles[2], (recompiles, dict(guard_failures))
    assert graphs[0] > 0 and graphs[0] == graphs[1] == graphs[2], graphs  # none for a new packing
    # one layer's pieces (around the attention), shared by both layers, and the head's two
    assert graphs[0] <= 8, graphs
    assert sampling._HEAD["slice_gradient"] is not sampling._slice_gradient  # the head ran compiled


def test_auto_checkpointing_sizes_for_a_sequence_longer_than_the_micro_batch(tiny_model, monkeypatch, capsys):
    """A sequence longer than --micro-batch-tokens is packed alone (batches.pack): the largest forward is
    --max-context tokens, not --micro-batch-tokens (--micro-batch-tokens 1 is the unpacked run of
    docs/benchmarks.md). With free memory between the two, auto must turn checkpointing on."""
    flags = ["--micro-batch-tokens", "64", "--max-context", "2048", "--compile", "off"]
    args = script.parser.parse_args(["--model", str(tiny_model), *flags])
    args.compute_dtype = "fp32"
    config = AutoModelForCausalLM.from_pretrained(tiny_model).config
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    short, longest = (activation_bytes(config, n, bf16=False) for n in (64, 2048))
    free = (12 * params + (short + longest) / 2) / T.CHECKPOINT_HEADROOM
    monkeypatch.setattr(T, "free_memory", lambda device, taken_later=0.0: int(free))
    model, _, _ = T.load_models(args, None, torch.device("cpu"), world_size=1)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("gradient checkpointing"))
    assert model.is_gradient_checkpointing, line
    assert "2048-token" in line, line
