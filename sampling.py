"""What was sampled is what is trained: the one definition of the sampling distribution, shared by the
requests to vLLM and the trainer's logprobs (the streamed head), per-request seeds. fidelity.py checks
that every server samples this distribution.

vLLM's processed logprobs (`--logprobs-mode processed_logprobs`) are those of the distribution the
sampler drew from: penalties → temperature → min-p → top-k → top-p → log_softmax over what is left
(vllm/v1/sample/sampler.py). The trainer reproduces exactly that for the settings it supports
(temperature, top-k, top-p) and pins everything else to neutral in every request, so a server that fills
unset fields from the model's `generation_config.json` (vLLM's default `--generation-config auto`) still
samples the trainer's distribution. Truncation follows the rule of vLLM's PyTorch path (the CPU server's,
apply_top_k_top_p_pytorch): top-k keeps every logit ≥ the k-th largest (ties kept); top-p, after top-k,
drops the ascending-sorted prefix whose cumulative probability is ≤ 1 − p and always keeps the largest.
Ties at the top-p boundary (rare in fp32, common in bf16 logits): vLLM's sort keeps only m of the n
logits tied there, as many as its cumulative sum needs (which ones: the sort's order). Their logits are
equal, so m alone sets the normaliser, log Z = log(Σ_{l > t} e^l + m e^t), and m is the same whatever the
order among ties: the trainer counts each tied logit m / n times (_tie_weighted), its gradient spread
evenly over the n, and a kept tied token has vLLM's logprob t − log Z. Measured on bf16-rounded Gaussian
logits (σ 3, 32 rows of 32,000) at Qwen's defaults (temperature 0.7, top-p 0.8, top-k 20): keeping every
tie made 6 rows' logprobs up to 0.058 nats lower than vLLM's CPU sampler's (top-p 0.9 alone: 31 rows, up
to 0.0025); counting m, every row is within 1.0e-6 nats (fp32). Not matched: on CUDA, vLLM 0.32's Triton
kernel (topk_topp_triton.py) keeps exactly k of the logits tied at the k-th largest, where its PyTorch
path and the trainer keep them all.
"""

import hashlib
from dataclasses import dataclass

import torch

# vLLM's SamplingParams raises a temperature in (0, MIN_TEMPERATURE) to it (a warning in the server's
# log): it would sample there and the trainer divide by the asked one. 0 (greedy) is for evaluation.
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {self.temperature} is in (0, {MIN_TEMPERATURE}), which vLLM raises to "
                f"{MIN_TEMPERATURE}: sample at {MIN_TEMPERATURE} or more (or 0, greedy, for evaluation)"
            )

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
    are already divided by the temperature."""
    return _boundary(scaled_logits, sampling, rows_per_chunk)[0]


@torch.no_grad()
def _boundary(
    scaled_logits: torch.Tensor, sampling: Sampling, rows_per_chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row (N,): keep_threshold, and with top-p the fraction m / n of the n logits tied at it that
    vLLM keeps (1 where all are; None for top-k alone, which keeps every tie). Rows are sorted in chunks:
    a (T, V) sort of a whole packed micro-batch over a 150k vocabulary would take gigabytes."""
    n, vocab = scaled_logits.shape
    if sampling.top_p >= 1.0:  # top-k alone: no sort
        return scaled_logits.topk(min(sampling.top_k, vocab), dim=-1).values[:, -1], None
    out = torch.empty(n, dtype=scaled_logits.dtype, device=scaled_logits.device)
    tie_weight = torch.empty_like(out)
    for start in range(0, n, rows_per_chunk):
        chunk = scaled_logits[start : start + rows_per_chunk]
        ascending = chunk.sort(dim=-1).values  # (c, V)
        if sampling.top_k > 0:
            kth = ascending[:, vocab - min(sampling.top_k, vocab), None]
            ascending = ascending.masked_fill(ascending < kth, float("-inf"))
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        dropped = (cumulative <= 1 - sampling.top_p).sum(dim=-1).clamp(max=vocab - 1)  # a prefix
        boundary = ascending.gather(1, dropped[:, None])  # (c, 1)
        out[start : start + rows_per_chunk] = boundary[:, 0]
        # vLLM keeps the sorted entries from `dropped` on: of those tied with the boundary, all but the ones
        # above it. Tied values add equal terms to the cumulative sum, so `dropped`, and this count, are the
        # same whatever order the sort gives the ties.
        kept_tied = vocab - dropped - (ascending > boundary).sum(dim=-1)  # ≥ 1: the boundary itself
        tied = (ascending == boundary).sum(dim=-1)
        tie_weight[start : start + rows_per_chunk] = kept_tied.to(out.dtype) / tied.to(out.dtype)
    return out, tie_weight


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 and fp32 inputs; float64 stays float64 (tests run a whole step in float64 to check
    it against the hand-written one exactly, whatever the CPU's float32 summation order)."""
    return torch.promote_types(dtype, torch.float32)


def processed_logits(
    logits: torch.Tensor, sampling: Sampling, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """(N, V) logits of the distribution vLLM samples from, in fp32 at least: / temperature, then −inf
    outside the top-k / top-p set. Differentiable in the kept logits. `keep` (N,): a token per row that
    stays in the kept set whatever the truncation says (see token_logprobs_and_entropy). Every logit tied
    at the top-p boundary stays finite here, where vLLM keeps m of the n: a log_softmax over these counts
    all n (processed_logprobs counts m)."""
    scaled = logits.to(at_least_fp32(logits.dtype)) / sampling.temperature
    if not sampling.truncates:
        return scaled
    return scaled.masked_fill(scaled < _threshold(scaled.detach(), sampling, keep)[0][:, None], float("-inf"))


def processed_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(N, V) log π of every token under the distribution vLLM samples from: processed_logits minus the
    log-normaliser of the head (_row_statistics: the logits tied at the top-p boundary counted as many
    times as vLLM keeps them), so a token vLLM kept has vLLM's processed logprob (a tied one vLLM's sort
    dropped: the same finite value, −inf there). For the re-score's top dicts."""
    scaled = logits.to(at_least_fp32(logits.dtype)) / sampling.temperature
    if not sampling.truncates:
        return torch.log_softmax(scaled, dim=-1)
    threshold, tie_log_weight = _threshold(scaled.detach(), sampling, None)
    scaled = scaled.masked_fill(scaled < threshold[:, None], float("-inf"))
    return scaled - torch.logsumexp(_tie_weighted(scaled, threshold, tie_log_weight)[0], dim=-1, keepdim=True)


def _threshold(
    scaled: torch.Tensor, sampling: Sampling, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """keep_threshold, lowered where needed so that each row's `keep` token stays in its kept set, and
    (top-p) per row the log of the fraction of the logits tied at it that the set counts (_boundary's; 0
    where the threshold was lowered: the set then grows down to `keep`'s logit and keeps every tie)."""
    threshold, tie_weight = _boundary(scaled, sampling)
    if keep is not None:
        keep_logit = scaled.gather(1, keep[:, None])[:, 0]
        if tie_weight is not None:
            tie_weight = torch.where(keep_logit < threshold, 1.0, tie_weight)
        threshold = torch.minimum(threshold, keep_logit)
    return threshold, None if tie_weight is None else tie_weight.log()


def _tie_weighted(scaled, threshold, tie_log_weight):
    """(`scaled` with log(m / n) added to the n logits tied at each row's threshold, the tied positions
    (N, V) bool) or (`scaled`, None) without tie weights. vLLM's top-p keeps m of them; their logits are
    equal, so the count, not which ones, sets the normaliser: log Z = log(Σ_{l > t} e^l + m e^t). Weighing
    each of the n by m / n gives that value exactly and spreads its gradient evenly over the tied logits
    (m / n · e^t / Z each): symmetric, where vLLM's kept m are whichever its sort put last."""
    if tie_log_weight is None:
        return scaled, None
    tied = scaled == threshold[:, None]
    return scaled + torch.where(tied, tie_log_weight[:, None], 0.0), tied


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
    (masked) get finite logprobs this way too; the loss ignores whatever is there anyway.

    Logits tied at the top-p boundary count in the normalizer as many times as vLLM keeps them
    (_tie_weighted), and a tied target has vLLM's logprob, that of a kept token, e^t / Z."""
    return _logprobs_and_normalizer(logits, targets, sampling, with_entropy, False, _row_statistics)[:2]


def _logprobs_and_normalizer(
    logits, targets, sampling: Sampling, with_entropy: bool, keep_bits: bool, statistics
):
    """token_logprobs_and_entropy, and per row the log-normalizer, (`keep_bits`) the kept set and the
    logits tied at the top-p boundary as pack_bits' bits, and the tie's log-weight (_tie_weighted): what
    the streamed head's backward needs to rebuild the distribution a slice of the vocabulary at a time.
    The truncation's threshold is found here (a sort, or top-k); the rest is `statistics`:
    _row_statistics, or its compiled form (the head under --compile: compile_head)."""
    temperature, threshold, tie_log_weight = sampling.temperature, None, None
    if sampling.truncates:  # the threshold's sort reads the scaled logits, so they are made here, once
        logits = logits.to(at_least_fp32(logits.dtype)) / temperature
        threshold, tie_log_weight = _threshold(logits.detach(), sampling, targets)
        temperature = 1.0  # x / 1.0 is x
    out = statistics(logits, targets, threshold, tie_log_weight, temperature, with_entropy, keep_bits)
    return *out, tie_log_weight


def _row_statistics(
    logits, targets, threshold, tie_log_weight, temperature: float, with_entropy: bool, keep_bits: bool
):
    """From a chunk of rows' logits (N, V) to per-row values: log π(target), the entropy (no grad) or
    None, the log-normalizer, the kept set's bits and the tied logits' bits (or None). `threshold` (N,)
    or None: logits below it are −inf (off the kept set); `tie_log_weight` (N,) or None: the logits equal
    to it weigh that in the normalizer (_tie_weighted). Elementwise work and row reductions only: eager,
    in place where it can be (a few chunk-sized temporaries); compiled, inductor fuses it into a pass or
    two over the chunk. Differentiable in `logits`."""
    scaled = logits.to(at_least_fp32(logits.dtype))
    # x / 1.0 is x: no pass (eager: a chunk copy) for it, nor for logits scaled already
    if temperature != 1.0:
        scaled = scaled / temperature
    if threshold is not None:
        scaled = scaled.masked_fill(scaled < threshold[:, None], float("-inf"))
    weighted, tied = _tie_weighted(scaled, threshold, tie_log_weight)
    logz = torch.logsumexp(weighted, dim=-1)  # (N,)
    # a tied target's logit unweighted: vLLM kept it, and reports it at e^t / Z
    logprobs = scaled.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = kept = tied_bits = None
    with torch.no_grad():
        if with_entropy:
            probs = (weighted - logz[:, None]).exp_()  # 0 off the kept set; m / n · e^t / Z at a tie
            # 0 · (−inf) is nan: truncated tokens contribute nothing
            entropy = logz - probs.mul_(scaled.masked_fill(probs == 0, 0.0)).sum(-1)
        if keep_bits:
            kept = pack_bits(scaled != float("-inf"))
            tied_bits = None if tied is None else pack_bits(tied)
    return logprobs, entropy, logz.detach(), kept, tied_bits


def _slice_gradient(
    logits, logz, g, local_targets, kept, tied, tie_log_weight, temperature: float, out_dtype: torch.dtype
):
    """d loss / d logits of one slice of the vocabulary (N, c) over every row: g (1[j = t] − π_j) /
    temperature, π_j = exp(logit_j / temperature − logz) on the kept set (`kept`: the slice's bits, or
    None), 0 off it, times m / n (exp of `tie_log_weight` (N,)) on the logits tied at the top-p boundary
    (`tied`: the slice's bits, or None; _tie_weighted); `local_targets` each row's target minus the
    slice's start (outside [0, c): none here). In `out_dtype`, what autocast's matmul backward sees.
    `logits`, the caller's temporary, is overwritten where it is already fp32 (a new 128 MiB tensor a
    slice costs its page faults on CPU)."""
    grad = logits.to(at_least_fp32(logits.dtype))
    if temperature != 1.0:  # x / 1.0 is x: no pass over the slice for it (here and at the end)
        grad.div_(temperature)
    if kept is not None:
        grad.masked_fill_(~unpack_bits(kept, logits.shape[1]), float("-inf"))
    grad.sub_(logz[:, None])
    if tied is not None:
        grad.add_(torch.where(unpack_bits(tied, logits.shape[1]), tie_log_weight[:, None], 0.0))
    grad.exp_().mul_(-g[:, None])  # −g π_j: 0 off the kept set
    if torch.compiler.is_compiling():  # + g at each row's target: a compare, fused into the one pass
        columns = torch.arange(logits.shape[1], device=logits.device)
        grad = grad + torch.where(columns[None, :] == local_targets[:, None], g[:, None], 0.0)
    else:  # eager: one write per row, in place (the compare would make two chunk-sized temporaries)
        inside = (local_targets >= 0) & (local_targets < logits.shape[1])
        grad.scatter_add_(1, local_targets.clamp(0, logits.shape[1] - 1)[:, None], (g * inside)[:, None])
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(out_dtype)


# The head's elementwise functions as the head calls them: eager, or compiled (compile_head).
_HEAD = {"row_statistics": _row_statistics, "slice_gradient": _slice_gradient}


def compile_head(on: bool) -> None:
    """The streamed head's elementwise work (_row_statistics, _slice_gradient) through torch.compile
    (inductor, dynamic shapes: one graph for every chunk and slice size), or back to eager. Eager, each
    op is a pass through memory over the chunk's logits (~15 in the forward, ~8 in the backward, most in
    fp32); fused, one or two over the bf16 logits. The matmuls, the truncation's sort and the loops over
    chunks stay eager. Called by trainer.compile_model under --compile."""
    for name, fn in (("row_statistics", _row_statistics), ("slice_gradient", _slice_gradient)):
        _HEAD[name] = torch.compile(fn, dynamic=True) if on else fn


# ---------------------------------------------------------------------------------------------------
# THE HEAD: logprobs from the final hidden states, streamed over the positions that are needed
# ---------------------------------------------------------------------------------------------------
# Logits per chunk of the streamed head: 128 MiB per fp32 chunk, 220 rows of Qwen's 151,936 vocabulary in
# the forward, 2,048 columns of a 16k-token micro-batch in the backward. A chunk's working set is a handful
# of such tensors (the logits, their processed copy, the softmax, the sort of a top-p threshold), so the
# head's extra memory is bounded by the chunk, the weight's bf16 copy and its gradient, not by the row:
# the (T, V) fp32 logits of a 16k-token row are 10 GB (bench/bench_trainer.py measures it).
HEAD_CHUNK_LOGITS = 2**25


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bf16: bool) -> torch.Tensor:
    """(N, V) logits of hidden (N, H) through the LM head weight (V, H), in bf16 when `bf16` (what
    autocast would do: both operands cast, fp32 accumulation inside the matmul), else in the weight's
    dtype. The one place the head's matmul is written."""
    dtype = torch.bfloat16 if bf16 else weight.dtype
    return hidden.to(dtype) @ weight.to(dtype).T


class _StreamedHead(torch.autograd.Function):
    """token_logprobs_and_entropy over the logits hidden @ weight.T without the (N, V) logits. The
    forward goes a chunk of rows at a time (a row's truncation and normalizer need all of its
    vocabulary) and keeps each row's log-normalizer and, with truncation, its kept set as bits (a
    threshold would not do: the backward's logits come from another matmul shape, so a logit tied with
    the threshold can round to either side of it), and with top-p the logits tied at its boundary as
    bits too, with their weight (_tie_weighted; 2 · N · V / 8 bytes of bits in all). The backward goes a
    slice of the vocabulary at a time over every row, recomputing that slice's logits: each slice of the
    weight's gradient is one matmul over all N positions, written once (summing it over 110-row chunks
    instead read and wrote the whole fp32 (V, H) gradient per chunk: on an H200 the 1.5B step was
    1.28-1.32x slower, docs/trainer.md). The gradient is that of the processed distribution: d log π(t) /
    d logit_j = (1[j = t] − π_j) / temperature over the kept set (π_j = 0 outside it, where the −inf fill
    gives no gradient; m / n · e^{l_j} / Z on the n logits tied at the top-p boundary), the same as
    autograd through token_logprobs_and_entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, sampling: Sampling, with_entropy: bool, bf16: bool, chunk: int):
        w = weight.to(torch.bfloat16) if bf16 else weight  # cast once, not per chunk
        acc = at_least_fp32(hidden.dtype)
        n = len(targets)
        logprobs, logz = hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)
        vocab = weight.shape[0]
        keep_bits = sampling.truncates and any(ctx.needs_input_grad[:2])  # not for the reference, a re-score
        kept = hidden.new_empty((n, -(-vocab // 8)), dtype=torch.uint8) if keep_bits else None
        # top-p's ties: which logits tie at the boundary, and how much each weighs (_tie_weighted)
        tied = torch.empty_like(kept) if keep_bits and sampling.top_p < 1 else None
        tie_log_weight = hidden.new_empty(n, dtype=acc) if tied is not None else None
        rows = max(1, chunk // vocab)
        for start in range(0, n, rows):
            end = start + rows
            lp, ent, logz[start:end], bits, tied_bits, log_weight = _logprobs_and_normalizer(
                head_logits(hidden[start:end], w, bf16), targets[start:end], sampling, with_entropy,
                keep_bits, _HEAD["row_statistics"],
            )  # fmt: skip
            logprobs[start:end] = lp
            if with_entropy:
                entropy[start:end] = ent
            if kept is not None:
                kept[start:end] = bits
            if tied is not None:
                tied[start:end], tie_log_weight[start:end] = tied_bits, log_weight
        ctx.save_for_backward(hidden, weight, targets, logz, kept, tied, tie_log_weight)
        ctx.sampling, ctx.bf16, ctx.chunk = sampling, bf16, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, logz, kept, tied, tie_log_weight = ctx.saved_tensors
        sampling, bf16 = ctx.sampling, ctx.bf16
        w = weight.to(torch.bfloat16) if bf16 else weight
        h = hidden.to(w.dtype)  # cast once: every slice's matmuls read all of it
        acc = at_least_fp32(weight.dtype)
        g = grad_logprobs.to(acc)
        # a frozen LM head (LoRA) takes no gradient: no (V, H) fp32 tensor, a third fewer matmuls
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if wants_hidden else None
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device) if wants_weight else None
        vocab, cols = weight.shape[0], max(8, ctx.chunk // max(1, len(targets)) // 8 * 8)  # whole bytes
        for start in range(0, vocab, cols):
            end = min(start + cols, vocab)
            byte_columns = slice(start // 8, -(-end // 8))
            grad = _HEAD["slice_gradient"](
                head_logits(h, w[start:end], bf16), logz, g, targets - start,
                None if kept is None else kept[:, byte_columns],
                None if tied is None else tied[:, byte_columns], tie_log_weight,
                sampling.temperature, w.dtype,
            )  # fmt: skip
            if wants_hidden:  # fp32 over slices
                grad_hidden += grad @ w[start:end]
            if wants_weight:
                grad_weight[start:end] = grad.T @ h
        return (
            grad_hidden.to(hidden.dtype) if wants_hidden else None,
            grad_weight.to(weight.dtype) if wants_weight else None,
            None, None, None, None, None,
        )  # fmt: skip


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """(N, V) bool → (N, ⌈V/8⌉) uint8, column j in bit j % 8 of byte j // 8. Eight strided reads OR-ed
    together (and unpack_bits' eight masks stacked): written so, inductor fuses each into one pass (the
    shift-and-sum over a trailing axis of 8 compiled 40x slower on CPU than eager, ~1.5x faster so)."""
    padded = torch.nn.functional.pad(mask, (0, -mask.shape[1] % 8)).to(torch.uint8)
    packed = padded[:, 0::8]
    for bit in range(1, 8):
        packed = packed | (padded[:, bit::8] << bit)
    return packed


def unpack_bits(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """pack_bits' inverse: (N, B) uint8 → (N, columns) bool, columns ≤ 8 B."""
    bits = torch.stack([(packed & (1 << bit)) != 0 for bit in range(8)], dim=-1)
    return bits.flatten(1)[:, :columns]  # not view(N, -1): no rows (an empty micro-batch) leaves -1 unknown


def streamed_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    sampling: Sampling,
    with_entropy: bool = False,
    bf16: bool = False,
    chunk_logits: int = HEAD_CHUNK_LOGITS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs_and_entropy(hidden @ weight.T, targets, ...) without the (N, V) logits: hidden (N, H)
    the final hidden states of the positions that predict `targets` (N,), weight (V, H) the LM head's.
    Differentiable in hidden and weight (entropy: no grad). Returns (logprobs (N,), entropy (N,) or None)."""
    if not torch.is_grad_enabled():  # no backward will come (π_old, a re-score): pack no kept bits for one
        hidden, weight = hidden.detach(), weight.detach()
    lp, entropy = _StreamedHead.apply(hidden, weight, targets, sampling, with_entropy, bf16, chunk_logits)
    return lp, (entropy if with_entropy else None)


_NO_LOGITS: dict = {}  # device → an empty index: the model's own LM head computes no logits at all


def final_hidden(model, input_ids, position_ids, bf16: bool = False, attention: dict | None = None):
    """(T, H) hidden states after the final norm of one packed row (1, T), the forward under bf16
    autocast when `bf16`. Through the model's own forward (FSDP's root hooks gather the root's weights,
    the LM head's included) with an empty `logits_to_keep`, so no logits are computed. `attention`:
    extra forward kwargs for the packed attention (collate's, from the sequence lengths known on the
    host: no device→host transfer to find the boundaries)."""
    device = input_ids.device
    keep = _NO_LOGITS.setdefault(device, torch.empty(0, dtype=torch.long, device=device))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep,
            output_hidden_states=True, **(attention or {}),
        )  # fmt: skip
    return out.hidden_states[-1][0]  # the last is after the final norm (transformers' capture_outputs)


def head_weight(model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the streamed head takes an LM head without bias (Qwen2/Qwen3, Llama)")
    return head.weight


def token_logprobs(
    model,
    input_ids,
    position_ids,
    sampling: Sampling,
    with_entropy: bool = False,
    bf16: bool = False,
    *,
    positions: torch.Tensor | None = None,
    attention: dict | None = None,
):
    """log π(token_j | tokens < j) under the distribution vLLM samples from (temperature, top-k, top-p:
    above) at the `positions` j ≥ 1 of a packed row (1, T) (collate's "positions": the loss's tokens and
    every token of a traced sequence; None: every j ≥ 1), 0 elsewhere. `attention`: collate's packed
    attention kwargs (None: the attention finds the sequences from the position restarts). `bf16`: the
    forward under bf16 autocast (--compute-dtype bf16); the head's matmul in bf16, its log-softmax in
    fp32 either way.
    The trainer, the reference model and the fidelity re-score all score tokens here.
    Returns (logprobs (T,), entropy (T,) or None)."""
    T = input_ids.shape[1]
    if positions is None:
        positions = torch.arange(1, T, device=input_ids.device)
    hidden = final_hidden(model, input_ids, position_ids, bf16, attention)  # (T, H)
    # position j − 1 predicts token j; each target stays in its row's kept set (see above)
    lp, entropy = streamed_logprobs(
        hidden[positions - 1], head_weight(model), input_ids[0, positions], sampling, with_entropy, bf16
    )
    zeros = lp.new_zeros(T)
    lp = zeros.index_copy(0, positions, lp)
    return lp, (zeros.index_copy(0, positions, entropy) if with_entropy else None)


@torch.no_grad()
def rescore(model, samples: list, device, bf16: bool) -> list[tuple[list[float], list[list[float]]]]:
    """The trainer's logprobs of each probe sample (fidelity.ProbeSample): of its completion's tokens,
    through the head training uses (token_logprobs' path: final_hidden → streamed_logprobs), and of the
    ids of each position's top dict, from the same forward. One forward for all the samples: one packed
    row, each sample attending to itself alone (its positions restart at 0). Only the positions that
    predict a completion token go through the vocabulary projection: the prompts' logits (most of the
    row) are never computed."""
    rows = [s.prompt_ids + s.completion_ids for s in samples]
    ids = torch.tensor([[t for r in rows for t in r]], device=device)
    position_ids = torch.cat([torch.arange(len(r)) for r in rows]).to(device)[None]
    hidden = final_hidden(model, ids, position_ids, bf16)  # (Σ len, H)
    weight, out, offset = head_weight(model), [], 0
    for s, r in zip(samples, rows):
        start = offset + len(s.prompt_ids)
        predicting = hidden[start - 1 : offset + len(r) - 1]  # (completion length, H): each its token
        lp, _ = streamed_logprobs(predicting, weight, ids[0, start : offset + len(r)], s.sampling, bf16=bf16)
        full = processed_logprobs(head_logits(predicting, weight, bf16), s.sampling)
        top = [full[j, list(d)].tolist() for j, d in enumerate(s.top)]
        out.append((lp.tolist(), top))
        offset += len(r)
    return out
