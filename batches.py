"""The data side of a step: the endless row stream the rollout worker reads (and where a resume picks it
up: StreamPosition), the groups a step takes off the worker's queue (and why none came, when none did),
their sequences packed into padding-free micro-batches for the forward pass, and the attention that
keeps packed sequences apart.

Packing: every micro-batch is ONE row of concatenated sequences (no padding) whose position_ids restart
at 0 for each sequence. Left to itself, transformers (≥ 4.54) detects the restarts and builds a dense
T × T block-diagonal causal mask for sdpa: attention then costs (Σ len)² per row, and long packed rows
trained slower than one sequence per forward (bench/bench_packing.py, figure 2a "before"). The
trainer's models load with the attention `packed_attention` picks once at start-up instead: for bf16 on
GPU torch's varlen flash attention (`packed_varlen`, one kernel over the row), else flash-attention 2
when `flash_attn` imports; elsewhere `per_sequence_sdpa`, causal sdpa on each sequence's slice of the
row. All cost Σ len², build no mask, and take the boundaries from the lengths collate knows on the host.
Sequences do not see each other: tests/test_packing.py checks logprobs and gradients against
one-sequence-at-a-time forwards (the varlen one on a GPU).
"""

import functools
import importlib.util
import inspect
import itertools
import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from vllm_server import healthy


# ---------------------------------------------------------------------------------------------------
# DATA: an endless shuffled stream of rows that can start anywhere
# ---------------------------------------------------------------------------------------------------
def row_stream(rows: list[dict], seed: int, start: int = 0, pending: list[int] = ()):
    """Row i of the stream is rows[perm_e[i % N]] with e = i // N and perm_e a seeded permutation per
    epoch. Each row carries `_index` = its stream position. A resumed run gives first the rows of
    `pending` (admitted before the checkpoint, never trained: StreamPosition), then i = start, start + 1, …"""
    n = len(rows)
    # Each epoch shuffled once, not once a pending row: a shuffle of 1.8M rows (DAPO-Math-17k) takes 1-2 s,
    # in the rollout worker's event loop.
    permutation = functools.lru_cache(maxsize=2)(functools.partial(_permutation, n, seed))
    for i in pending:
        yield {**rows[permutation(i // n)[i % n]], "_index": i}
    i = start
    while True:
        epoch, perm = i // n, permutation(i // n)
        for j in range(i % n, n):
            yield {**rows[perm[j]], "_index": epoch * n + j}
        i = (epoch + 1) * n


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    perm = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(perm)
    return perm


@dataclass
class StreamPosition:
    """Where a resumed run picks the row stream up. The worker admits rows in stream order, so every
    index below the highest one the trainer has consumed was admitted: `frontier` is that index + 1, and
    `pending` the indices below it that were not consumed (still generating, queued, or taken by a step
    that did not finish). Consumed = taken off the queue by a finished step (trained, or dropped as
    stale or equal-reward, as an uninterrupted run drops it) or failed by the worker after its retries.
    A resume admits `pending` first, then the stream from `frontier`; admitted rows at or above the
    frontier are generated again from the stream. So no row is trained twice and none is skipped."""

    frontier: int = 0
    pending: set[int] = field(default_factory=set)

    def consume(self, indices) -> None:
        """Idempotent: an index consumed again changes nothing."""
        for i in indices:
            if i >= self.frontier:
                self.pending.update(range(self.frontier, i))
                self.frontier = i + 1
            else:
                self.pending.discard(i)


# ---------------------------------------------------------------------------------------------------
# BATCHES: wait for groups, drop stale ones, skip zero-variance ones, explain a timeout
# ---------------------------------------------------------------------------------------------------
class BatchTimeout(RuntimeError):
    pass


def explain_batch_timeout(
    waited_s: float, have: int, need: int, worker_alive: bool, rows_exhausted: bool, stats, client_stats,
    health: dict[str, bool], dropped_stale: int, skipped_equal: int, out_of_routing: set[str],
) -> str:  # fmt: skip
    """Why no batch came: the likeliest cause first, then every counter that bears on it."""
    reasons = []
    down = [u for u, ok in health.items() if not ok]
    if not worker_alive:
        reasons.append("the rollout worker died (see its traceback in the log above)")
    if down:
        reasons.append(f"vLLM server(s) not healthy: {', '.join(down)}")
    if out_of_routing - set(down):
        reasons.append(
            f"vLLM server(s) answer but are out of routing: {', '.join(sorted(out_of_routing - set(down)))} "
            "(not holding the trainer's weights; the lines above say why the re-sync failed)"
        )
    if rows_exhausted:
        reasons.append("the dataset rows are exhausted")
    if stats.groups_failed and stats.groups_failed >= stats.groups_done:
        reasons.append(f"most groups failed ({stats.groups_failed}); last error: {stats.last_error}")
    if skipped_equal and skipped_equal >= dropped_stale and skipped_equal > have:
        reasons.append(
            f"all rewards equal in {skipped_equal} groups (skipped as zero-variance: the task may be too "
            "hard or too easy for this model; --keep-zero-variance trains on them anyway)"
        )
    if dropped_stale and dropped_stale > have:
        reasons.append(
            f"{dropped_stale} groups dropped as stale (raise --max-staleness, or leave out --drop-stale)"
        )
    if not reasons:
        reasons.append("generation is slower than the timeout allows (raise --batch-timeout)")
    return (
        f"no batch after {waited_s:.0f} s ({have}/{need} groups): " + "; ".join(reasons) + ". Counters: "
        f"groups started {stats.groups_started}, done {stats.groups_done}, retried {stats.groups_retried}, "
        f"failed {stats.groups_failed}, discarded {stats.groups_discarded}; dropped stale {dropped_stale}, "
        f"skipped equal-reward {skipped_equal}; requests {client_stats.requests}, "
        f"retries {client_stats.retries}; servers {health}"
    )


def collect_groups(
    worker,
    num_groups: int,
    version: int,
    args,
    urls: list[str],
    stop_flag,
    heal=None,
    heal_every_s: float = 5.0,
) -> tuple:
    """Take groups off the queue until `num_groups` usable ones are in hand; while waiting, call `heal`
    every `heal_every_s` (a server that went away may be back).

    Returns (groups, taken, dropped_stale, skipped_equal, wait_s); `taken` is every group removed from
    the queue (for the dataset position). Staleness = trainer version − version the group was admitted
    at; a group above --max-staleness is trained (IS-corrected) unless --drop-stale."""
    groups, taken, dropped, skipped = [], [], 0, 0
    t0 = time.monotonic()
    deadline, next_heal = t0 + args.batch_timeout, t0 + heal_every_s
    while len(groups) < num_groups:
        if stop_flag["stop"]:
            raise KeyboardInterrupt
        if heal is not None and time.monotonic() > next_heal:
            heal()
            next_heal = time.monotonic() + heal_every_s
        # Past the deadline nothing more is taken, also while groups keep coming: skipped or dropped ones
        # arriving faster than the poll would otherwise keep the wait going as long as the rows last.
        try:
            group = None if time.monotonic() > deadline else worker.queue.get(timeout=0.5)
        except Exception:  # queue.Empty
            group = None
        if group is None and (time.monotonic() > deadline or not worker.alive):
            health = {u: healthy(u) for u in urls}
            raise BatchTimeout(
                explain_batch_timeout(
                    time.monotonic() - t0,
                    len(groups),
                    num_groups,
                    worker.alive,
                    worker.exhausted,
                    worker.stats,
                    worker.client.stats,
                    health,
                    dropped,
                    skipped,
                    worker.client.down,
                )  # fmt: skip
            ) from None
        if group is None:
            continue
        taken.append(group)
        staleness = version - group.admitted_version
        if args.drop_stale and staleness > args.max_staleness:
            dropped += 1
            worker.discard(1)
        elif not args.keep_zero_variance and max(group.rewards) == min(group.rewards):
            skipped += 1
            worker.discard(1)
        else:
            group.staleness = staleness
            groups.append(group)
    return groups, taken, dropped, skipped, time.monotonic() - t0


# ---------------------------------------------------------------------------------------------------
# PACKING: sequences → micro-batches of one padding-free row each
# ---------------------------------------------------------------------------------------------------
def batch_sequences(groups) -> list[dict]:
    """One dict per completion with per-token arrays over prompt + completion (mask 0 on the prompt)."""
    seqs = []
    for g in groups:
        for c, adv in zip(g.completions, g.advantages, strict=True):  # never a completion left out
            n_p = len(g.prompt_ids)
            seqs.append({
                "ids": g.prompt_ids + c.completion_ids,
                "mask": [0] * n_p + c.loss_mask,
                "behaviour": [0.0] * n_p + c.behaviour_logprobs,
                "advantage": float(adv),
            })  # fmt: skip
    return seqs


def pack(seqs: list[dict], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices of sequences per micro-batch, each ≤ `budget` tokens (a longer
    sequence goes alone)."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]["ids"]))
    bins: list[list[int]] = []
    sizes: list[int] = []
    for i in order:
        n = len(seqs[i]["ids"])
        for b, size in enumerate(sizes):
            if size + n <= budget:
                bins[b].append(i)
                sizes[b] += n
                break
        else:
            bins.append([i])
            sizes.append(n)
    return bins


def collate(seqs: list[dict], device) -> dict:
    """One packed row. Per-token arrays are aligned with `input_ids`; position j's logprob is predicted
    at j − 1, and the first token of every sequence is a prompt token (mask 0), so the shift never
    trains across a sequence boundary. Built on the host and sent in one pass (pinned, non-blocking on
    CUDA: the host does not wait for the GPU to drain); what the step needs on the host (the sequence
    lengths) stays there, so nothing inside the step reads the device to find it.
    "positions" (P,): the tokens whose logprob the step needs (the loss's, and every token but the
    first of a sequence carrying a "trace" key: the rollout viewer shows the trainer's logprob of each);
    "attention": the packed attention's forward kwargs (attention_kwargs)."""
    ids = [x for s in seqs for x in s["ids"]]
    lengths = [len(s["ids"]) for s in seqs]
    positions, offset = [], 0
    for s, n in zip(seqs, lengths):
        traced = "trace" in s
        positions += [offset + j for j in range(1, n) if traced or s["mask"][j]]
        offset += n
    host = {
        "input_ids": torch.tensor(ids)[None],  # (1, T)
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],  # (1, T)
        "loss_mask": torch.tensor([x for s in seqs for x in s["mask"]], dtype=torch.float32),  # (T,)
        "behaviour": torch.tensor([x for s in seqs for x in s["behaviour"]], dtype=torch.float32),  # (T,)
        "advantages": torch.tensor([s["advantage"] for s in seqs for _ in s["ids"]], dtype=torch.float32),
        "seq_index": torch.tensor([k for k, n in enumerate(lengths) for _ in range(n)]),  # (T,)
        "positions": torch.tensor(positions, dtype=torch.long),  # (P,)
    }
    out = {k: to_device(v, device) for k, v in host.items()}
    out["attention"] = attention_kwargs(lengths, device)
    return out


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: a copy from pinned memory is queued on the current
    stream and the host goes on (the caching host allocator keeps the pinned block until it is done)."""
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


# ---------------------------------------------------------------------------------------------------
# ATTENTION: each sequence of a packed row attends only to itself, at a cost of Σ len²
# ---------------------------------------------------------------------------------------------------
PER_SEQUENCE_SDPA = "per_sequence_sdpa"
PACKED_VARLEN = "packed_varlen"
TORCH_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None  # torch ≥ 2.10
_segments_cache: list = [None, -1, []]  # (position_ids tensor, its version, its sequence lengths)


def attention_kwargs(lengths: list[int], device) -> dict:
    """The forward kwargs that tell the packed attention where the row's sequences are, from lengths
    known on the host: `seq_lengths` (per_sequence_sdpa splits by it), cumulative int32 boundaries and the
    longest length (packed_varlen, and transformers' flash_attention_2, which otherwise works them out
    from the position restarts with a device→host read per forward)."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    cu = to_device(cu, device)
    longest = max(lengths, default=0)
    return {"seq_lengths": lengths, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}  # fmt: skip


def sequence_lengths(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the sequences of a packed row (1, T) whose caller gave none (attention_kwargs): a new
    one starts wherever the position does not go up by one (transformers' rule,
    masking_utils.find_packed_sequence_indices). Every layer of one forward gets the same tensor, so the
    (device-syncing) lengths are worked out once per forward."""
    tensor, version, lengths = _segments_cache
    if position_ids is not tensor or position_ids._version != version:
        pos = position_ids[0]
        starts = torch.cat([pos.new_zeros(1), 1 + (pos[1:] != pos[:-1] + 1).nonzero()[:, 0]])
        bounds = torch.cat([starts, starts.new_tensor([len(pos)])]).tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        _segments_cache[:] = [position_ids, position_ids._version, lengths]
    return lengths


def _one_row(name: str, query: torch.Tensor, key: torch.Tensor, position_ids) -> None:
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or position_ids is None:
        raise ValueError(
            f"{name} runs one packed row (batch 1, position_ids, no KV cache); got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, position_ids {position_ids is not None}: "
            "load the model with attn_implementation='sdpa' for other uses"
        )


# What a model's attention may do that the packed attentions do not apply (each would train it with another
# attention than vLLM serves): refused, never ignored.
UNAPPLIED = {
    "sliding_window": "a sliding window",
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
}


def unapplied_attention(config, max_context: int) -> str | None:
    """What of `config`'s attention (a transformers config) the trainer's packed attention would not
    apply to sequences of up to `max_context` tokens, as the one line that says so; None if nothing. A
    sliding window at least as long as every sequence changes nothing."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    windowed = "sliding_attention" in layer_types if layer_types else window is not None
    if windowed and window is not None and window < max_context:
        what = f"{UNAPPLIED['sliding_window']} of {window} tokens (shorter than --max-context {max_context})"
    elif getattr(config, "attn_logit_softcapping", None) is not None:
        what = UNAPPLIED["softcap"]
    elif config.model_type == "gpt_oss":
        what = UNAPPLIED["s_aux"]
    else:
        return None
    return (
        f"its attention uses {what}, which the trainer's packed attention ({PER_SEQUENCE_SDPA}, "
        f"{PACKED_VARLEN}) does not apply: it would train another attention than vLLM serves. Use a model "
        "without it, or load it with attn_implementation='flash_attention_2' (trainer.load_models)"
        + (", or keep --max-context within the window" if "window" in what else "")
    )


def _applies(name: str, kwargs: dict, longest: int) -> None:
    """The forward-time guard behind unapplied_attention (a model loaded around the start-up check)."""
    window = kwargs.get("sliding_window")
    for key, what in UNAPPLIED.items():
        if kwargs.get(key) is not None and not (key == "sliding_window" and window >= longest):
            raise ValueError(f"{name} does not apply {what} ({key}={kwargs[key]!r}): see unapplied_attention")


def per_sequence_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    seq_lengths: list[int] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (AttentionInterface) for the trainer's packed rows: causal sdpa
    on each sequence's slice of the row, so the cost is Σ len² and no T × T mask exists. query (1, H, T,
    D), key/value (1, H_kv, T, D) → (1, T, H, D). Needs position_ids (the row's restarts, read when no
    `seq_lengths` came with the forward) and takes no KV cache and no padding mask: the trainer's
    forwards have neither (transformers builds no mask for an attention it has no mask function for, so
    a padding mask would be dropped, not applied)."""
    _one_row(PER_SEQUENCE_SDPA, query, key, position_ids)
    lengths = seq_lengths or sequence_lengths(position_ids)
    _applies(PER_SEQUENCE_SDPA, kwargs, max(lengths))
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
        )  # (1, H, len, D)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 2)  # (1, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def packed_varlen(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """torch's varlen flash attention (torch.nn.attention.varlen.varlen_attn, CUDA, bf16) over the whole
    packed row in one kernel: causal within each sequence, cost Σ len². Same contract as
    per_sequence_sdpa; the boundaries come from attention_kwargs (else from the position restarts).
    Flash kernels have no fp32: rotary embeddings promote q and k to fp32 under autocast, so they are
    cast back to bf16 here (what sdpa's autocast rule does), and the output is bf16."""
    from torch.nn.attention.varlen import varlen_attn

    _one_row(PACKED_VARLEN, query, key, position_ids)
    if dropout:
        raise ValueError(f"{PACKED_VARLEN} has no dropout")
    if cu_seq_lens_q is None:  # a forward without collate's kwargs (one sequence, a test)
        found = attention_kwargs(sequence_lengths(position_ids), query.device)
        cu_seq_lens_q, max_length_q = found["cu_seq_lens_q"], found["max_length_q"]
    _applies(PACKED_VARLEN, kwargs, max_length_q)
    q, k, v = (t[0].transpose(0, 1).to(torch.bfloat16) for t in (query, key, value))  # (T, H, D)
    out = varlen_attn(
        q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
        **_varlen_causal(varlen_attn, gqa=k.shape[1] != q.shape[1]),
    )  # fmt: skip
    return out[None], None  # (1, T, H, D)


@functools.cache
def _varlen_causal(varlen_attn, gqa: bool) -> dict:
    """varlen_attn's keywords for causal attention, by the signature of this torch's: 2.10 took
    is_causal, 2.11 window_size=(-1, 0); 2.13 also wants enable_gqa for fewer KV heads (the flash kernel
    always ran GQA; 2.13 checks that the caller meant it)."""
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def packed_attention(device: torch.device, compute_dtype: str) -> str:
    """The attn_implementation of the trainer's models, chosen once at start-up. For bf16 compute on
    GPU: torch's own varlen flash attention where this torch has it (packed_varlen), else
    flash-attention 2 when `flash_attn` imports (transformers turns the boundaries into varlen calls);
    neither has fp32 kernels. Otherwise per-sequence sdpa. The custom ones are registered here."""
    if device.type == "cuda" and compute_dtype == "bf16":
        if TORCH_VARLEN:
            AttentionInterface.register(PACKED_VARLEN, packed_varlen)
            return PACKED_VARLEN
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    AttentionInterface.register(PER_SEQUENCE_SDPA, per_sequence_sdpa)
    return PER_SEQUENCE_SDPA
