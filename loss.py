"""GRPO loss: group-normalized advantages and a token-level PPO-clip loss with truncated IS.

Three log-probabilities of the same sampled tokens meet here (under the sampling distribution, sampling.py):
  logprobs            log π_θ    the trainer's current policy; carries the gradient.
  old_logprobs        log π_old  the trainer's own logprob before this optimizer step (no grad).
                                 With one optimizer step per batch it equals logprobs.detach();
                                 with --mini-batches N > 1, a no-grad pass before the first step.
  behaviour_logprobs  log μ      what vLLM sampled with (processed logprobs). μ ≠ π_old because the
                                 sample is stale (older weights) and inference kernels differ.

Departures from textbook GRPO (DeepSeekMath):
  - asymmetric clip [1 − ε_low, 1 + ε_high] ("clip-higher", DAPO), defaults 0.2 / 0.28;
  - truncated importance sampling: each token's objective is weighted by min(π_old/μ, C), detached
    (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training");
  - token-mean over the global batch by default (DAPO), not a mean of per-sequence means;
  - no KL to a reference by default (β = 0); when on, the k3 estimator as in DeepSeekMath;
  - advantages use the population std (ddof = 0) and may skip the std division (Dr. GRPO).
"""

from typing import Literal

import torch


def group_advantages(
    rewards: torch.Tensor | list[float], scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages of one group (G completions of one prompt): A_i = (r_i − mean r) / (std r + eps).

    std is the population std (divide by G, not G − 1): defined for G = 1, and ±1 for a two-valued
    group with equal counts. TRL uses the sample std, so its advantages are smaller by
    sqrt((G − 1)/G). scale_by_std=False gives r_i − mean r (Dr. GRPO).

    Equal rewards give exactly 0 for any float, by test rather than by arithmetic: the mean of eight
    0.7s is not 0.7 in floating point, and the rounding error divided by std + eps is an advantage of
    up to 5e-2 that --keep-zero-variance would train on. Computed in float64, returned as float32.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if not bool(torch.isfinite(r).all()):
        # NaN/inf would make every advantage of the group NaN, and the batch's loss with it
        raise ValueError(
            f"non-finite reward in {r.tolist()}: the environment's reward must return a finite float"
        )
    if r.numel() == 0 or bool((r == r[0]).all()):
        return torch.zeros(r.shape, dtype=torch.float32)
    adv = r - r.mean()
    return (adv / (r.std(correction=0) + eps) if scale_by_std else adv).float()


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    is_cap: float = 2.0,
    loss_norm: Literal["token", "sequence"] = "token",
    total_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped, IS-corrected policy loss over one packed micro-batch.

    Inputs are 1-D over the T tokens of several concatenated sequences (no padding): `advantages`
    is each sequence's advantage repeated over its tokens; `loss_mask` is 1 = train this token,
    0 = prompt / tool output / template; `seq_index` (int64) numbers each token's sequence 0..S−1.
    Values at masked positions may be anything, −inf and NaN included (a truncated distribution gives
    −inf to a prompt token outside its kept set): they contribute exactly 0 to the loss, the metrics
    and the gradient.

        r_t   = exp(log π_θ − log π_old)                     PPO ratio
        w_t   = min(exp(log π_old − log μ), C)               truncated IS weight, detached
        k3_t  = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1
        ℓ_t   = −w_t · min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t) + β k3_t
        token:    L = Σ_t m_t ℓ_t / total_tokens
        sequence: L = Σ_s (Σ_{t∈s} m_t ℓ_t / Σ_{t∈s} m_t) / num_sequences

    The denominators are counts over the GLOBAL batch (all micro-batches, all ranks), passed in by
    the caller, so that accumulating gradients over micro-batches gives the exact batch token mean;
    a per-micro-batch mean would weight each token by the size of the micro-batch it landed in.
    DDP/FSDP average gradients over ranks, so multiply the loss by the world size. None falls back
    to this micro-batch's own count (tokens, or sequences with at least one loss token).

    Metrics (detached) are SUMS over the loss tokens of this micro-batch — add them across
    micro-batches and ranks, divide by the summed `tokens` — except `is_ratio_max` (take the max):
      tokens        number of loss tokens
      clip_low      tokens with A < 0 and r < 1 − ε_low (clipped: no gradient)
      clip_high     tokens with A > 0 and r > 1 + ε_high (clipped: no gradient)
      is_ratio      π_old/μ before the cap; is_ratio_max its max; is_capped tokens with π_old/μ > C
      mismatch_kl   k3 estimate of KL(μ ‖ π_old), the train–inference mismatch (tokens drawn from μ)
      kl_ref        k3_t (only when kl_beta > 0)
      entropy       the per-token entropy passed in (only when given; needs full logits, not here)
    """
    if loss_norm not in ("token", "sequence"):
        raise ValueError(f"loss_norm must be 'token' or 'sequence', got {loss_norm!r}")
    m = loss_mask.to(logprobs.dtype)
    on = loss_mask.bool()
    # Masked positions are replaced by 0 BEFORE any arithmetic: −inf − (−inf) is NaN, NaN × 0 is NaN, and
    # a where() after the arithmetic would still send NaN back through exp() in the backward pass.
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(on, logprobs, zero)
    old = torch.where(on, old_logprobs.detach(), zero)
    beh = torch.where(on, behaviour_logprobs.detach(), zero)
    advantages = torch.where(on, advantages, zero)
    if ref_logprobs is not None:
        ref_logprobs = torch.where(on, ref_logprobs.detach(), zero)

    ratio = torch.exp(logprobs - old)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    log_is = old - beh
    is_ratio = torch.exp(log_is)
    w = is_ratio.clamp(max=is_cap)
    per_token = -w * torch.minimum(ratio * advantages, clipped * advantages)
    if kl_beta > 0:
        assert ref_logprobs is not None, "kl_beta > 0 needs ref_logprobs"
        d = ref_logprobs.detach() - logprobs
        k3 = torch.exp(d) - d - 1
        per_token = per_token + kl_beta * k3

    if loss_norm == "token":
        denom = total_tokens if total_tokens is not None else m.sum().clamp(min=1)
        loss = (per_token * m).sum() / denom
    else:
        # T slots, not max(seq_index) + 1: reading the max would be a device→host sync; the slots of no
        # sequence hold 0 / 1 = 0.
        zeros = torch.zeros(seq_index.numel(), dtype=m.dtype, device=m.device)
        seq_sum = zeros.index_add(0, seq_index, per_token * m)  # (S,)
        seq_len = zeros.index_add(0, seq_index, m)  # (S,)
        denom = num_sequences if num_sequences is not None else (seq_len > 0).sum().clamp(min=1)
        loss = (seq_sum / seq_len.clamp(min=1)).sum() / denom

    with torch.no_grad():
        metrics = {
            "tokens": m.sum(),
            "clip_low": ((advantages < 0) & (ratio < 1 - eps_low) & on).sum().to(m.dtype),
            "clip_high": ((advantages > 0) & (ratio > 1 + eps_high) & on).sum().to(m.dtype),
            "is_ratio": (is_ratio * m).sum(),
            # is_ratio > 0, so the 0s of the masked positions never win (and no boolean index: a sync)
            "is_ratio_max": torch.where(on, is_ratio, zero).max() if on.numel() else m.new_zeros(()),
            "is_capped": ((is_ratio > is_cap) & on).sum().to(m.dtype),
            "mismatch_kl": ((is_ratio - log_is - 1) * m).sum(),
        }
        if kl_beta > 0:
            metrics["kl_ref"] = (k3 * m).sum()
        if entropy is not None:
            metrics["entropy"] = torch.where(on, entropy.detach(), zero).sum()
    return loss, metrics
