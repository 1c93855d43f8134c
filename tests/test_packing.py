"""Packed attention (batches.per_sequence_sdpa): each sequence of a packed row attends only to itself.
Logprobs and gradients of the packed forward equal one-sequence-at-a-time forwards through transformers'
own sdpa (fp32 within rounding, bf16 within the existing bound); the trainer loads it and says so."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import batches
from batches import PACKED_VARLEN, PER_SEQUENCE_SDPA, collate, packed_attention, sequence_lengths
from sampling import Sampling, token_logprobs
from trainer import load_models


def _seqs(lengths: list[int], seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "ids": torch.randint(0, 500, (n,), generator=gen).tolist(),
            "mask": [0] * 3 + [1] * (n - 3),
            "behaviour": [0.0] * n,
            "advantage": 1.0,
        }
        for n in lengths
    ]


LENGTHS = [14, 7, 40, 4, 19]  # uneven, one very short


@pytest.fixture(scope="module")
def models(tiny_model):
    """(the trainer's packed-attention model, the same weights on transformers' plain sdpa)."""
    attn = packed_attention(torch.device("cpu"), "bf16")
    assert attn == PER_SEQUENCE_SDPA
    packed = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attn)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    return packed, plain


def _alone(model, seqs, sampling: Sampling, bf16: bool = False, device="cpu") -> torch.Tensor:
    """Logprobs of each sequence in a forward of its own (no packing at all), concatenated."""
    out = []
    for s in seqs:
        ids = torch.tensor(s["ids"], device=device)[None]
        positions = torch.arange(ids.shape[1], device=device)[None]
        lp, _ = token_logprobs(model, ids, positions, sampling, bf16=bf16)
        out.append(lp)
    return torch.cat(out)


def test_sequence_lengths_follow_the_position_restarts():
    pos = torch.tensor([[*range(5), *range(3), 0, *range(6)]])
    assert sequence_lengths(pos) == [5, 3, 1, 6]
    assert sequence_lengths(torch.arange(9)[None]) == [9]
    pos[0, 5:] = torch.arange(5, 15)  # the same tensor changed in place: worked out again, not cached
    assert sequence_lengths(pos) == [15]


def test_packed_logprobs_equal_one_sequence_at_a_time_fp32(models):
    packed_model, plain = models
    seqs = _seqs(LENGTHS)
    mb = collate(seqs, "cpu")
    with torch.no_grad():
        packed, entropy = token_logprobs(
            packed_model, mb["input_ids"], mb["position_ids"], Sampling(0.7), with_entropy=True
        )
        alone = _alone(plain, seqs, Sampling(0.7))
        dense, _ = token_logprobs(plain, mb["input_ids"], mb["position_ids"], Sampling(0.7))
    mask = mb["loss_mask"].bool()  # every sequence's first token (a prompt token) has no logprob
    torch.testing.assert_close(packed[mask], alone[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)  # transformers' T × T mask path
    assert entropy.shape == packed.shape and (entropy[mask] > 0).all()


def test_packed_gradients_equal_one_sequence_at_a_time(models):
    """A backward through the packed row gives every weight the gradient of the unpacked forwards."""
    packed_model, plain = models
    seqs = _seqs(LENGTHS, seed=1)
    mb = collate(seqs, "cpu")
    weights = torch.linspace(-1.0, 1.0, mb["input_ids"].shape[1]) * mb["loss_mask"]  # every token its own
    for model in models:
        model.zero_grad(set_to_none=True)
    lp, _ = token_logprobs(packed_model, mb["input_ids"], mb["position_ids"], Sampling(0.9))
    (lp * weights).sum().backward()
    (_alone(plain, seqs, Sampling(0.9)) * weights).sum().backward()
    for (name, p), q in zip(packed_model.named_parameters(), plain.parameters()):
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_bf16_logprobs_match_fp32_one_sequence_at_a_time(models):
    """bf16 autocast through the packed attention, against fp32 forwards of each sequence alone: within
    the bound of test_train.py::test_bf16_compute_logprobs_match_fp32 (0.02 nats)."""
    packed_model, plain = models
    seqs = _seqs(LENGTHS, seed=2)
    mb = collate(seqs, "cpu")
    with torch.no_grad():
        bf16, _ = token_logprobs(packed_model, mb["input_ids"], mb["position_ids"], Sampling(0.8), bf16=True)
        fp32 = _alone(plain, seqs, Sampling(0.8))
    mask = mb["loss_mask"].bool()
    assert not torch.equal(bf16[mask], fp32[mask])  # bf16 matmuls did run
    torch.testing.assert_close(bf16[mask], fp32[mask], atol=0.02, rtol=0)


def test_a_batch_of_rows_is_refused_in_one_line(models):
    packed_model, _ = models
    with pytest.raises(ValueError, match="runs one packed row"):
        packed_model(input_ids=torch.zeros(2, 5, dtype=torch.long), use_cache=False)


def test_the_trainer_loads_the_packed_attention_and_names_it(tiny_model, capsys):
    args = SimpleNamespace(
        model=str(tiny_model), kl_beta=0.1, compute_dtype="fp32", gradient_checkpointing="auto",
        micro_batch_tokens=4096, max_context=2048,
    )  # fmt: skip
    model, ref_model, _ = load_models(args, None, torch.device("cpu"), world_size=1)
    assert model.config._attn_implementation == ref_model.config._attn_implementation == PER_SEQUENCE_SDPA
    assert f"trainer attention: {PER_SEQUENCE_SDPA}" in capsys.readouterr().out


def test_varlen_flash_attention_only_for_bf16_on_gpu(monkeypatch):
    """No GPU needed: the choice alone. torch's varlen attention where this torch has it, else
    flash-attention 2 when it imports (a stand-in module here), else per-sequence sdpa."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert batches.TORCH_VARLEN  # torch 2.13 has it
    assert packed_attention(cuda, "bf16") == PACKED_VARLEN
    assert packed_attention(cuda, "fp32") == PER_SEQUENCE_SDPA  # flash kernels have no fp32
    assert packed_attention(cpu, "bf16") == PER_SEQUENCE_SDPA
    monkeypatch.setattr(batches, "TORCH_VARLEN", False)
    assert packed_attention(cuda, "bf16") == PER_SEQUENCE_SDPA  # flash_attn is not installed here
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    assert packed_attention(cuda, "bf16") == "flash_attention_2"
    assert packed_attention(cpu, "bf16") == PER_SEQUENCE_SDPA


def test_collate_gives_the_boundaries_from_the_host_lengths():
    seqs = _seqs(LENGTHS)
    seqs[1]["trace"] = 0  # a traced sequence: every token but its first is scored
    mb = collate(seqs, "cpu")
    assert mb["attention"]["seq_lengths"] == LENGTHS
    assert mb["attention"]["cu_seq_lens_q"].tolist() == [0, 14, 21, 61, 65, 84]
    assert mb["attention"]["max_length_q"] == 40
    assert sequence_lengths(mb["position_ids"]) == LENGTHS  # the same as the restarts say
    expected = [j for j in range(1, 84) if mb["loss_mask"][j] or 14 < j < 21]
    assert mb["positions"].tolist() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's varlen flash attention)")
def test_varlen_logprobs_and_gradients_equal_one_sequence_at_a_time_on_gpu(tiny_model):
    """The packed row through packed_varlen (bf16, one kernel) against each sequence alone through
    transformers' sdpa, both under bf16 autocast: logprobs within the bf16 bound of
    test_packed_bf16_logprobs_match_fp32_one_sequence_at_a_time (0.02 nats); gradients within bf16's
    relative rounding (2^-8 per operand, a few ulps through the layers: rtol 0.05 of the largest)."""
    cuda = torch.device("cuda")
    attn = packed_attention(cuda, "bf16")
    assert attn == PACKED_VARLEN
    load = lambda impl: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        tiny_model, dtype=torch.float32, attn_implementation=impl
    ).to(cuda)
    packed, plain = load(attn), load("sdpa")
    seqs = _seqs(LENGTHS, seed=3)
    mb = collate(seqs, cuda)
    weights = torch.linspace(-1.0, 1.0, mb["input_ids"].shape[1], device=cuda) * mb["loss_mask"]
    lp, _ = token_logprobs(
        packed, mb["input_ids"], mb["position_ids"], Sampling(0.9), bf16=True, attention=mb["attention"]
    )
    alone = _alone(plain, seqs, Sampling(0.9), bf16=True, device=cuda)
    mask = mb["loss_mask"].bool()
    torch.testing.assert_close(lp[mask], alone[mask], atol=0.02, rtol=0)
    (lp * weights).sum().backward()
    (alone * weights).sum().backward()
    for (name, p), q in zip(packed.named_parameters(), plain.parameters()):
        scale = q.grad.abs().max()
        assert (p.grad - q.grad).abs().max() <= 0.05 * scale + 1e-6, name


def test_an_attention_the_packed_attention_does_not_apply_is_refused(tiny_model):
    """A sliding window shorter than the sequences, logit soft-capping, attention sinks: the per-sequence
    attention would silently train full attention where vLLM serves the model's own. Refused at start-up
    from the config, and in the forward of a model loaded around that check; a window longer than every
    sequence changes nothing and passes."""
    from transformers import AutoConfig, Gemma2Config, GptOssConfig

    from batches import unapplied_attention

    config = AutoConfig.from_pretrained(tiny_model)
    assert unapplied_attention(config, 2048) is None
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    assert "a sliding window of 8 tokens" in unapplied_attention(config, 2048)
    assert unapplied_attention(config, 8) is None
    assert "logit soft-capping" in unapplied_attention(Gemma2Config(sliding_window=4096), 2048)
    assert "attention sinks" in unapplied_attention(GptOssConfig(sliding_window=4096), 2048)

    packed_attention(torch.device("cpu"), "fp32")  # registers it
    model = AutoModelForCausalLM.from_config(config, attn_implementation=PER_SEQUENCE_SDPA)
    ids, positions = torch.arange(1, 13)[None], torch.cat([torch.arange(6), torch.arange(6)])[None]
    token_logprobs(model, ids, positions, Sampling())  # sequences of 6 within the window of 8: applies
    with pytest.raises(ValueError, match="does not apply a sliding window"):
        token_logprobs(model, ids, torch.arange(12)[None], Sampling())  # one of 12: it would not
