"""The data side of a step: the endless row stream the rollout worker reads (and where a resume picks it
up: StreamPosition), the groups a step takes off the worker's queue (and why none came, when none did),
their sequences packed into padding-free micro-batches for the forward pass, and the attention that
keeps packed sequences apart.

Packing: every micro-batch is ONE row of concatenated sequences (no padding) whose position_ids restart
at 0 for each sequence. Left to itself, transformers (≥ 4.54) detects the restarts and builds a dense
T × T block-diagonal causal mask for sdpa: attention then costs (Σ len)² per row, and long packed rows
trained slower than one sequence per forward (bench/bench_packing.py, figure 2a "before"). The
trainer's models load with the attention `packed_attention` picks once at start-up instead:
flash-attention 2 for bf16 on GPU when `flash_attn` imports (transformers turns the restarts into varlen
boundaries), else `per_sequence_sdpa`, causal sdpa on each sequence's slice of the row: Σ len², no
mask. Either way sequences do not see each other: tests/test_packing.py checks logprobs and gradients
against one-sequence-at-a-time forwards.
"""

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
    for i in pending:
        yield {**rows[_permutation(n, seed, i // n)[i % n]], "_index": i}
    i = start
    while True:
        epoch, perm = i // n, _permutation(n, seed, i // n)
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
        try:
            group = worker.queue.get(timeout=0.5)
        except Exception:  # queue.Empty
            if time.monotonic() > deadline or not worker.alive:
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
        for c, adv in zip(g.completions, g.advantages):
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


def collate(seqs: list[dict], device) -> dict[str, torch.Tensor]:
    """One packed row. Per-token arrays are aligned with `input_ids`; position j's logprob is predicted
    at j − 1, and the first token of every sequence is a prompt token (mask 0), so the shift never
    trains across a sequence boundary."""
    cat = lambda key, dtype: torch.tensor([x for s in seqs for x in s[key]], dtype=dtype, device=device)  # noqa: E731
    return {
        "input_ids": cat("ids", torch.long)[None],  # (1, T)
        "position_ids": torch.cat([torch.arange(len(s["ids"])) for s in seqs]).to(device)[None],  # (1, T)
        "loss_mask": cat("mask", torch.float32),  # (T,)
        "behaviour": cat("behaviour", torch.float32),  # (T,)
        "advantages": torch.tensor(
            [s["advantage"] for s in seqs for _ in s["ids"]], dtype=torch.float32, device=device
        ),  # (T,)
        "seq_index": torch.tensor([k for k, s in enumerate(seqs) for _ in s["ids"]], device=device),  # (T,)
    }


# ---------------------------------------------------------------------------------------------------
# ATTENTION: each sequence of a packed row attends only to itself, at a cost of Σ len²
# ---------------------------------------------------------------------------------------------------
PER_SEQUENCE_SDPA = "per_sequence_sdpa"
_segments_cache: list = [None, -1, []]  # (position_ids tensor, its version, its sequence lengths)


def sequence_lengths(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the sequences of a packed row (1, T): a new one starts wherever the position does not
    go up by one (transformers' rule, masking_utils.find_packed_sequence_indices). Every layer of one
    forward gets the same tensor, so the (device-syncing) lengths are worked out once per forward."""
    tensor, version, lengths = _segments_cache
    if position_ids is not tensor or position_ids._version != version:
        pos = position_ids[0]
        starts = torch.cat([pos.new_zeros(1), 1 + (pos[1:] != pos[:-1] + 1).nonzero()[:, 0]])
        bounds = torch.cat([starts, starts.new_tensor([len(pos)])]).tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        _segments_cache[:] = [position_ids, position_ids._version, lengths]
    return lengths


def per_sequence_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (AttentionInterface) for the trainer's packed rows: causal sdpa
    on each sequence's slice of the row, so the cost is Σ len² and no T × T mask exists. query (1, H, T,
    D), key/value (1, H_kv, T, D) → (1, T, H, D). Needs position_ids (the row's restarts) and takes no
    KV cache and no padding mask: the trainer's forwards have neither (transformers builds no mask for
    an attention it has no mask function for, so a padding mask would be dropped, not applied)."""
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or position_ids is None:
        raise ValueError(
            f"{PER_SEQUENCE_SDPA} runs one packed row (batch 1, position_ids, no KV cache); got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, position_ids {position_ids is not None}: "
            "load the model with attn_implementation='sdpa' for other uses"
        )
    lengths = sequence_lengths(position_ids)
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
        )  # (1, H, len, D)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 2)  # (1, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def packed_attention(device: torch.device, compute_dtype: str) -> str:
    """The attn_implementation of the trainer's models, chosen once at start-up: flash-attention 2 for
    bf16 compute on GPU when it imports (varlen over the row's restarts; it has no fp32 kernels), else
    per-sequence sdpa (registered here)."""
    if device.type == "cuda" and compute_dtype == "bf16":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    AttentionInterface.register(PER_SEQUENCE_SDPA, per_sequence_sdpa)
    return PER_SEQUENCE_SDPA
