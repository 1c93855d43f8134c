"""Asynchronous GRPO for multi-turn tool use: vLLM generates while the trainer trains.

    # CPU, one process: launches its own vLLM server on the model, then trains
    python train_async_grpo.py --model models/tiny --env retool --max-steps 20

    # against servers that are already running (vllm_server.py or `make serve`)
    python train_async_grpo.py --model models/tiny --env retool --vllm-url http://127.0.0.1:8000

    # continue a run where its last checkpoint left it
    python train_async_grpo.py --model models/tiny --env retool --output-dir runs/x --resume

    # curves
    python scripts/plot_metrics.py runs/x/metrics.jsonl --out runs/x/plots

One GPU box: `--vllm-gpus K` runs vLLM servers on GPUs 0..K-1 (`--vllm-tp` GPUs each) and trainer rank r
on GPU K + r; K defaults to every GPU the ranks leave (2 GPUs, one process: server on 0, trainer on 1).
The plan is checked before anything starts and printed in one line; one GPU needs --vllm-url.

    torchrun --nproc-per-node 6 train_async_grpo.py --model Qwen/Qwen2.5-7B-Instruct --vllm-gpus 2

    # the same distributed code on CPU (gloo), as tests/test_train.py runs it
    python -m torch.distributed.run --nproc-per-node 2 train_async_grpo.py --model models/tiny-warm

    # several nodes (scripts/multinode.sbatch): servers on their own nodes (vllm_server.py --host), node i
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank i --master-addr NODE0 --master-port 29500 \
        train_async_grpo.py --model Qwen/Qwen2.5-7B-Instruct --vllm-url http://SERVER:8000

Multi-rank (WORLD_SIZE > 1): FSDP2 (`fully_shard` on each decoder layer, then the root; nccl on GPU,
gloo on CPU). Rank 0 owns the servers, the rollout worker, eval, metrics and writing checkpoints; each
step it broadcasts the packed sequences (or a stop message, so an error or Ctrl-C on rank 0 ends every
rank), every rank packs them identically, trains on micro-batches rank::world_size and scales its loss
by world_size (FSDP averages gradients over ranks; the denominators are the whole batch's). Every rank
joins the gathers of the weight sync and of the checkpoints (full state dicts, model and optimizer,
gathered to rank 0's CPU), so a checkpoint is the same files whatever the number of ranks.

The loop. A background thread (rollout.AsyncRolloutWorker) keeps generating scored groups of
`--num-generations` completions per prompt into a bounded queue; it admits a new group only while it
stays within `--max-staleness` versions ahead of the trainer. The trainer takes `--prompts-per-step`
groups per step (in the order they finish, so a slow group can arrive later than that bound: it is
trained all the same, IS-corrected; `--drop-stale` drops it instead), skips groups whose rewards are all
equal (their advantage is zero), packs the sequences, takes `--mini-batches` AdamW steps (default one),
and every `--sync-every` steps pushes its weights into the servers (weight_sync.WeightSyncer); the
model version then increments.

Choices a reader should know before the code (see loss.py for the loss's own departures):
  - Staleness is counted in model versions (one version = one weight sync = `--sync-every` steps), the
    unit of admission (`--max-staleness`), of `--drop-stale` and of the per-token lag metrics
    (rollout/token_lag_*: trainer version − oldest version of the token's turn, an upper bound).
  - Late groups are kept: their behaviour logprobs are exact whatever the version, so the truncated IS
    weight min(π_old/μ, C) corrects them. Dropping them (`--drop-stale`) biases the run against long
    episodes (a group is as slow as its slowest completion; in ReTool those are the multi-turn tool
    episodes) and throws their compute away; rollout/trained_vs_admitted_len shows the bias.
  - Default: one optimizer step per batch, so π_old (the trainer's logprob before the update) is the
    current forward's logprobs detached; no second forward pass, the PPO ratio is 1 and the clip inert.
    `--mini-batches N` splits the batch's sequences into N and takes one step on each, with π_old from
    one no-grad pass before the first: a real trust region (train/clip_*_frac > 0), for one extra
    forward. The denominators are each mini-batch's; train/loss and train/grad_norm are their means.
  - `--rollout-cpus` puts the rollout thread, and the threads and processes it starts, on those CPUs
    and the trainer on the rest (envs.confine.pin_to_rollout_cpus), so that generation-side work does not
    slow the trainer's step. Python work in the rollout thread still shares the trainer's GIL.
  - Precision: fp32 weights and AdamW state, bf16 forward/backward on GPU (`--compute-dtype`; autocast in
    one process, FSDP2's MixedPrecisionPolicy over fp32 shards); the sync casts to the servers' bf16.
    bf16 weights would not train: at lr 1e-6 an update is far below half a bf16 ulp.
  - Logprobs are those of the distribution vLLM samples from (logits / T, then top-k / top-p
    truncation and renormalization: sampling.py), matching vLLM's processed logprobs. Every request
    states every sampling field, and a start-up probe refuses a server that samples otherwise.
  - Packing: every micro-batch is ONE row of concatenated sequences (no padding) whose position_ids
    restart at 0 for each sequence. With `use_cache=False` and no attention_mask, transformers (≥ 4.54)
    detects the restarts and builds a block-diagonal causal mask (sdpa, eager) or varlen boundaries
    (flash-attention), so sequences do not see each other; tests/test_train.py checks that packed
    logprobs equal one-sequence-at-a-time logprobs. The mask is (T × T) per micro-batch on sdpa: keep
    `--micro-batch-tokens` a few thousand.
  - train/mismatch_kl is k3 KL(μ ‖ π_old) over the whole batch; all micro-batches are before the update.
  - Accuracy = share of completions with reward ≥ 1 (the envs give exactly 1.0 for a correct answer).
  - Answers are checked in a small pool of worker processes (envs/verify.py), `--reward-timeout`
    seconds each; an overrun is killed, scored wrong and counted (rollout/ and eval/reward_timeouts).
  - Evaluation (`--eval-every`) is greedy (temperature 0) on the held-out split through the same servers
    and the same tool loop, while training rollouts keep running; also at the start (a step-0 line in
    metrics.jsonl with only eval/ keys, before rollouts begin; not on resume) and at the last step.
  - Resume: rows are shuffled with the seed (a new permutation each epoch) and read as one endless
    stream; the checkpoint stores the stream position just after the last row whose group the trainer
    took off the queue. Rows still in flight at that moment and before it are not revisited (a few
    rows lost, none trained twice). The rollout worker starts at the resumed version.
    metrics.jsonl is appended to, so steps a killed run logged after its last checkpoint appear twice;
    scripts/plot_metrics.py keeps the last line per step.
  - A server that dies or restarts does not stop the run (`heal`): the client stops routing to it, a
    weight sync it fails is reported and the others get it; a server launched here is relaunched; once
    a server answers without our weight version (a restart says "default") it gets a new transfer group
    and the current weights, and only then does the client route to it again. The run stops (with a
    checkpoint) only if no batch comes within --batch-timeout.
  - Ctrl-C and SIGTERM are deferred once the servers are up: the run stops between steps, never inside
    an optimizer step, a weight sync or a checkpoint write.
  - Shutdown (end, Ctrl-C, SIGTERM, exception): stop the rollout worker → final checkpoint (also after a
    batch timeout, which strikes between steps; not after an exception mid-step) → release the
    weight-sync group → stop the servers. Launched servers' process groups are in
    <output_dir>/vllm-logs/servers.json for cleanup after a kill -9.
"""

import argparse
import asyncio
import datetime
import functools
import inspect
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import ENVS, load_env, verify
from envs.confine import ROLLOUT_CPUS_ENV, parse_cpus
from envs.data import load_rows
from loss import grpo_loss
from rollout import (
    AsyncRolloutWorker,
    ChatTemplate,
    RolloutContext,
    VLLMClient,
    tool_loop_rollout,
)
from sampling import FidelityError, Sampling, check_fidelity, probe_server, token_logprobs_and_entropy

# fmt: off
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
# Model, environment, data
parser.add_argument("--model", required=True, help="model directory or hub name (Qwen2-style causal LM)")
parser.add_argument("--env", default="retool", choices=sorted(ENVS), help="environment (envs/)")
parser.add_argument("--dataset", default="data/retool_train.jsonl", help="training rows (jsonl, parquet)")
parser.add_argument("--eval-dataset", default="data/retool_test.jsonl", help="held-out rows for --eval-every")
parser.add_argument("--chat-template", default=None, help="jinja file replacing the tokenizer's template")
parser.add_argument("--output-dir", default="runs/latest", help="metrics, trajectories, checkpoints")
parser.add_argument("--seed", type=int, default=0, help="seeds torch, python and the row shuffle")
# Rollouts
parser.add_argument("--vllm-url", action="append", default=None,
                    help="a running vLLM server (repeatable); none = launch our own")
parser.add_argument("--sync-host", default=None,
                    help="address of this host the servers dial to join the weight sync (default: this "
                         "host's end of the route to the first non-local server; 127.0.0.1 if all are local)")
parser.add_argument("--vllm-gpus", type=int, default=None,
                    help="GPUs 0..K-1 for launched servers (default: every GPU the trainer ranks leave; "
                         "CPU: one server)")
parser.add_argument("--vllm-tp", type=int, default=1, help="GPUs per launched server (tensor parallel)")
parser.add_argument("--server-timeout", type=float, default=600.0, help="start-up limit for launched servers")
parser.add_argument("--batch-timeout", type=float, default=600.0,
                    help="seconds to wait for one batch of groups before failing with the reason")
parser.add_argument("--prompts-per-step", type=int, default=8, help="groups (prompts) per optimizer step")
parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (G)")
parser.add_argument("--max-staleness", type=int, default=1,
                    help="versions the worker may admit ahead of the trainer (0 = sync); see --drop-stale")
parser.add_argument("--drop-stale", action="store_true",
                    help="drop groups that lag more than --max-staleness versions when trained (biased: "
                         "drops the slowest, i.e. longest, episodes); default: keep them, IS-corrected")
parser.add_argument("--rollout-cpus", default=None,
                    help="CPUs for the rollout thread and its tool/reward processes, e.g. '0' or '2-7'; "
                         "the trainer keeps the others (default: no pinning)")
parser.add_argument("--max-turns", type=int, default=4, help="assistant messages per completion")
parser.add_argument("--max-calls-per-turn", type=int, default=1,
                    help="hermes parallel calls: a turn continues after </tool_call> up to this many calls")
parser.add_argument("--max-context", type=int, default=2048, help="prompt + completion tokens, hard cap")
parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (also for logprobs)")
parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (trained exactly)")
parser.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (trained exactly)")
parser.add_argument("--sandbox-workers", type=int, default=8, help="concurrent tool (sandbox) processes")
parser.add_argument("--unsafe-sandbox", action="store_true",
                    help="run tools even where the sandbox cannot stop network access, reading the trainer's "
                    "environment or signalling it (README: Sandbox)")
parser.add_argument("--reward-timeout", type=float, default=verify.DEADLINE_S,
                    help="seconds per answer check; an overrun is killed and scored wrong")
parser.add_argument("--keep-zero-variance", action="store_true",
                    help="train on groups whose rewards are all equal (default: skip them)")
# GRPO loss
parser.add_argument("--eps-low", type=float, default=0.2, help="lower clip: ratio ≥ 1 − eps_low")
parser.add_argument("--eps-high", type=float, default=0.28, help="upper clip: ratio ≤ 1 + eps_high (DAPO)")
parser.add_argument("--is-cap", type=float, default=2.0, help="truncated IS cap C on π_old/μ")
parser.add_argument("--loss-norm", default="token", choices=["token", "sequence"],
                    help="token-mean over the batch (DAPO) or mean of per-sequence means")
parser.add_argument("--no-scale-rewards", action="store_true", help="advantage r − mean, no std division")
parser.add_argument("--kl-beta", type=float, default=0.0, help="k3 KL to the initial model (0 = none loaded)")
# Optimization
parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
parser.add_argument("--lr", type=float, default=1e-6, help="AdamW peak learning rate")
parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
parser.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"], help="after warm-up")
parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient-norm clip")
parser.add_argument("--compute-dtype", default=None, choices=["bf16", "fp32"],
                    help="forward/backward dtype over fp32 weights and optimizer state "
                         "(default: bf16 on GPU, fp32 on CPU)")
parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="packed tokens per forward pass")
parser.add_argument("--mini-batches", type=int, default=1,
                    help="optimizer steps per rollout batch, one per 1/N of it (> 1 makes the clip live)")
parser.add_argument("--sync-every", type=int, default=1,
                    help="push weights to vLLM every N steps; one model version = N steps")
# Logging and checkpoints
parser.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
parser.add_argument("--resume", nargs="?", const="latest", default=None,
                    help="continue from a checkpoint dir, or (no value) the latest in --output-dir")
parser.add_argument("--eval-every", type=int, default=0,
                    help="evaluate at start, every N steps and at the end (0 = never)")
parser.add_argument("--eval-limit", type=int, default=64, help="held-out rows per evaluation")
parser.add_argument("--log-completions-every", type=int, default=10, help="write trajectories every N steps")
parser.add_argument("--report-to", default="none", choices=["none", "tensorboard", "wandb", "trackio"],
                    help="experiment tracker (only if installed)")
# fmt: on


def check_args(args: argparse.Namespace) -> None:
    """Bad arguments fail here, before any server or model is started, naming the argument."""
    positive = ["prompts_per_step", "num_generations", "max_turns", "max_calls_per_turn", "max_context",
                "max_steps", "micro_batch_tokens", "sync_every", "save_every", "vllm_tp", "sandbox_workers",
                "log_completions_every", "eval_limit", "mini_batches"]  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    for name in ["max_staleness", "warmup_steps", "eval_every", "kl_beta", "eps_low", "eps_high",
                 "weight_decay", "lr", "top_k"]:  # fmt: skip
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 0, got {getattr(args, name)}")
    if args.vllm_gpus is not None and args.vllm_gpus < 1:
        parser.error(f"--vllm-gpus must be ≥ 1, got {args.vllm_gpus}")
    if args.reward_timeout <= 0:
        parser.error(f"--reward-timeout must be > 0 seconds, got {args.reward_timeout}")
    if args.temperature <= 0:
        parser.error(
            f"--temperature must be > 0 for training (logprobs divide by it), got {args.temperature}"
        )
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.is_cap <= 0 or args.max_grad_norm <= 0:
        parser.error("--is-cap and --max-grad-norm must be > 0")
    if args.eps_low >= 1:
        parser.error(f"--eps-low must be < 1, got {args.eps_low}")
    if args.mini_batches > args.prompts_per_step * args.num_generations:
        parser.error(
            f"--mini-batches {args.mini_batches} exceeds the {args.prompts_per_step * args.num_generations} "
            "sequences of a batch (--prompts-per-step × --num-generations)"
        )
    if args.rollout_cpus is not None:
        try:
            cpus = parse_cpus(args.rollout_cpus)
        except ValueError:
            parser.error(f"--rollout-cpus: {args.rollout_cpus!r} is not a CPU list like '0' or '2-5,7'")
        if max(cpus) >= (os.cpu_count() or 1):
            parser.error(f"--rollout-cpus: CPU {max(cpus)} does not exist ({os.cpu_count()} CPUs)")
    if args.num_generations < 2:
        parser.error(
            f"--num-generations must be ≥ 2 (group advantages need a group), got {args.num_generations}"
        )
    for name in ["dataset", "eval_dataset", "chat_template"]:
        path = getattr(args, name)
        if path and path.endswith((".jsonl", ".parquet", ".jinja")) and not os.path.exists(path):
            parser.error(f"--{name.replace('_', '-')}: {path} does not exist")
    if not os.path.exists(args.model) and "/" not in args.model:
        parser.error(f"--model: {args.model} is neither a directory nor a hub name")
    if args.resume not in (None, "latest") and not os.path.isdir(args.resume):
        parser.error(f"--resume: {args.resume} is not a checkpoint directory")
    if args.vllm_url:
        for u in args.vllm_url:
            if not u.startswith(("http://", "https://")):
                parser.error(f"--vllm-url must start with http:// or https://, got {u}")


def sampling_of(args: argparse.Namespace) -> Sampling:
    return Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)


# ---------------------------------------------------------------------------------------------------
# DATA: an endless shuffled stream of rows that can start anywhere
# ---------------------------------------------------------------------------------------------------
def row_stream(rows: list[dict], seed: int, start: int = 0):
    """Row i of the stream is rows[perm_e[i % N]] with e = i // N and perm_e a seeded permutation per
    epoch. Each row carries `_index` = its stream position (the checkpoint's dataset position)."""
    n, i = len(rows), start
    while True:
        epoch = i // n
        perm = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        for j in range(i % n, n):
            yield {**rows[perm[j]], "_index": epoch * n + j}
        i = (epoch + 1) * n


# ---------------------------------------------------------------------------------------------------
# BATCHES: wait for groups, drop stale ones, skip zero-variance ones, explain a timeout
# ---------------------------------------------------------------------------------------------------
class BatchTimeout(RuntimeError):
    pass


def server_health(urls: list[str], timeout_s: float = 2.0) -> dict[str, bool]:
    health = {}
    for u in urls:
        try:
            with urllib.request.urlopen(f"{u}/health", timeout=timeout_s) as r:
                health[u] = r.status == 200
        except OSError:
            health[u] = False
    return health


def explain_batch_timeout(
    waited_s: float, have: int, need: int, worker_alive: bool, rows_exhausted: bool, stats, client_stats,
    health: dict[str, bool], dropped_stale: int, skipped_equal: int, out_of_routing: set[str],
) -> str:  # fmt: skip
    """Why no batch came: the likeliest cause first, then every counter that bears on it."""
    reasons = []
    down = [u for u, ok in health.items() if not ok]
    if not worker_alive:
        reasons.append("the rollout worker thread died (see its traceback in the log above)")
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
                health = server_health(urls)
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


def token_logprobs(
    model, input_ids, position_ids, sampling: Sampling, with_entropy: bool = False, bf16: bool = False
):
    """log π(token_j | tokens < j) under the distribution vLLM samples from (temperature, top-k, top-p:
    sampling.py) for every position of a packed row (position 0 gets 0: nothing predicts it). `bf16`:
    the forward under bf16 autocast (--compute-dtype bf16); the log-softmax is fp32 either way.
    Returns (logprobs (T,), entropy (T,) or None)."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]  # (T, V)
    # (T−1, V): position j−1 predicts token j
    lp, entropy = token_logprobs_and_entropy(logits[:-1], input_ids[0, 1:], sampling, with_entropy)
    zero = lp.new_zeros(1)
    return torch.cat([zero, lp]), (torch.cat([zero, entropy]) if with_entropy else None)


# ---------------------------------------------------------------------------------------------------
# TRAIN STEP: every rank holds the whole batch and trains on its share of the micro-batches
# ---------------------------------------------------------------------------------------------------
def train_step(
    model, ref_model, optimizer, scheduler, seqs, args, rank, world_size, device, traced: dict | None = None
) -> dict:
    """Forward/backward over this rank's packed micro-batches, then a clipped AdamW step: once per
    mini-batch (--mini-batches N splits the batch's sequences into N; N = 1 is one step on the whole
    batch). The loss denominators count the whole mini-batch (all its micro-batches, all ranks); FSDP
    averages gradients over ranks, so each rank's loss is scaled by world_size and the update is the
    one-process update. π_old: with N = 1 the forward's own logprobs, detached (the ratio is 1 and the
    clip inert); with N > 1 one no-grad pass before the first step, so later mini-batches are clipped
    against the policy that existed before the update. The scheduler steps once per call.
    Returns the train/ metrics of the whole batch (fractions over all its tokens; loss and grad norm
    the mean over mini-batches). Sequences carrying a "trace" key (the completions logged this step) get
    their π_old (detached) in `traced` on rank 0, keyed by it."""
    # bf16 compute over fp32 weights: autocast runs the matmuls in bf16, the gradients land on the fp32
    # parameters, AdamW updates fp32 (a 1e-6 step is far below half a bf16 ulp: bf16 weights would not
    # move). Under FSDP2 the MixedPrecisionPolicy (shard_model) casts the gathered weights as well.
    bf16 = args.compute_dtype == "bf16"
    n_mini = getattr(args, "mini_batches", 1)
    minis = [seqs[j * len(seqs) // n_mini : (j + 1) * len(seqs) // n_mini] for j in range(n_mini)]
    mini_bins = [pack(mini, args.micro_batch_tokens) for mini in minis]
    old: list[list[torch.Tensor | None]] = [[None] * -(-len(b) // world_size) for b in mini_bins]
    if n_mini > 1:
        with torch.no_grad():
            for j, (mini, bins) in enumerate(zip(minis, mini_bins)):
                for i, mb_seqs in enumerate(rank_micro_batches(mini, bins, rank, world_size)):
                    mb = collate(mb_seqs, device)
                    old[j][i], _ = token_logprobs(
                        model, mb["input_ids"], mb["position_ids"], sampling_of(args), bf16=bf16
                    )
    sums: dict[str, float] = {}
    maxima = {"is_ratio_max": 0.0}
    grad_norms, lr = [], scheduler.get_last_lr()[0]
    traced_here: dict[int, list[float]] = {}
    for mini, bins, mini_old in zip(minis, mini_bins, old):
        total_tokens = float(sum(sum(s["mask"]) for s in mini))
        num_sequences = float(sum(1 for s in mini if sum(s["mask"]) > 0))
        mini_sums: dict[str, float] = {}
        optimizer.zero_grad(set_to_none=True)
        for mb_seqs, mb_old in zip(rank_micro_batches(mini, bins, rank, world_size), mini_old):
            mb = collate(mb_seqs, device)
            logprobs, entropy = token_logprobs(
                model, mb["input_ids"], mb["position_ids"], sampling_of(args), with_entropy=True, bf16=bf16
            )
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref, _ = token_logprobs(
                        ref_model, mb["input_ids"], mb["position_ids"], sampling_of(args), bf16=bf16
                    )
            loss, m = grpo_loss(
                logprobs, logprobs.detach() if mb_old is None else mb_old, mb["behaviour"], mb["advantages"],
                mb["loss_mask"], mb["seq_index"], eps_low=args.eps_low, eps_high=args.eps_high,
                is_cap=args.is_cap, loss_norm=args.loss_norm, total_tokens=max(total_tokens, 1.0),
                num_sequences=max(num_sequences, 1.0), ref_logprobs=ref, kl_beta=args.kl_beta,
                entropy=entropy,
            )  # fmt: skip
            (loss * world_size).backward()
            keep_traced(traced_here, mb_seqs, logprobs if mb_old is None else mb_old)
            mini_sums["loss"] = mini_sums.get("loss", 0.0) + loss.item()
            for k, v in m.items():
                if k == "is_ratio_max":
                    maxima[k] = max(maxima[k], v.item())
                else:
                    mini_sums[k] = mini_sums.get(k, 0.0) + v.item()
        mini_sums, maxima = reduce_over_ranks(mini_sums, maxima, world_size, device)
        for k, v in mini_sums.items():
            sums[k] = sums.get(k, 0.0) + v
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        grad_norm = (
            grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        )  # FSDP: DTensor
        grad_norms.append(grad_norm.item())
        optimizer.step()
    scheduler.step()
    if any("trace" in s for s in seqs):
        gathered = gather_traced(traced_here, world_size)
        if traced is not None:
            traced.update(gathered)
    ntok = max(sums.get("tokens", 0.0), 1.0)
    return {
        "train/loss": sums["loss"] / n_mini,
        "train/clip_low_frac": sums["clip_low"] / ntok,
        "train/clip_high_frac": sums["clip_high"] / ntok,
        "train/is_ratio_mean": sums["is_ratio"] / ntok,
        "train/is_ratio_max": maxima["is_ratio_max"],
        "train/is_capped_frac": sums["is_capped"] / ntok,
        "train/mismatch_kl": sums["mismatch_kl"] / ntok,
        "train/entropy": sums["entropy"] / ntok,
        "train/kl_ref": sums.get("kl_ref", 0.0) / ntok,
        "train/grad_norm": sum(grad_norms) / n_mini,
        "train/lr": lr,
        "train/loss_tokens": sums.get("tokens", 0.0),
        "train/micro_batches": float(sum(len(b) for b in mini_bins)),
        "train/optimizer_steps": float(n_mini),
    }


def keep_traced(traced: dict[int, list[float]], mb_seqs: list[dict], logprobs: torch.Tensor) -> None:
    """For the rollout viewer: the logprobs of this micro-batch's sequences that carry a "trace" key
    (its value is the key in `traced`), over all their tokens, detached. A filler micro-batch copies
    a real one, so it writes the same values again."""
    offset = 0
    for s in mb_seqs:
        n = len(s["ids"])
        if "trace" in s:
            traced[s["trace"]] = logprobs[offset : offset + n].detach().float().cpu().tolist()
        offset += n


def gather_traced(traced: dict[int, list[float]], world_size: int) -> dict[int, list[float]]:
    """Each rank knows the traced sequences of its own micro-batches only: gather them on rank 0 (a few
    sequences, on the steps that log completions)."""
    if world_size == 1:
        return traced
    parts = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(traced, parts, dst=0)
    return {k: v for part in parts or [] for k, v in part.items()}


# ---------------------------------------------------------------------------------------------------
# RANKS: torchrun → FSDP2; rank 0 broadcasts each batch, every rank trains on its share of it
# ---------------------------------------------------------------------------------------------------
def plan_devices(
    num_gpus: int, ranks: int, vllm_gpus: int | None, vllm_tp: int, launch_servers: bool, node_rank: int = 0
) -> tuple[list[str], list[str]]:
    """Where everything runs on one box: (CUDA_VISIBLE_DEVICES of each launched server, device of each
    trainer rank). Servers take GPUs 0..vllm_gpus−1 (`vllm_tp` each), rank r the GPU after them; with
    no --vllm-gpus the servers take every GPU the ranks leave. A layout that does not fit raises
    ValueError with one line saying what would. No GPU: one server and every rank on the CPU. Servers are
    launched on node 0 only (torchrun --nnodes): elsewhere the ranks start at GPU 0."""
    launch_servers = launch_servers and node_rank == 0
    if num_gpus == 0:
        return (["cpu"] if launch_servers else []), ["cpu"] * ranks
    if not launch_servers:  # --vllm-url: the servers are elsewhere (or on GPUs hidden from us)
        if ranks > num_gpus:
            raise ValueError(
                f"{ranks} trainer ranks but {num_gpus} GPU(s) visible: use --nproc-per-node ≤ {num_gpus}"
            )
        return [], [f"cuda:{r}" for r in range(ranks)]
    if num_gpus == 1:
        raise ValueError(
            "1 GPU visible: a launched vLLM server and the trainer cannot share it (no colocation); use 2 "
            "GPUs (one server, one trainer process), or start a server elsewhere and pass --vllm-url"
        )
    free = num_gpus - ranks  # what the trainer ranks leave for servers
    fits = []
    if free >= vllm_tp:
        fits.append(f"--vllm-gpus {free // vllm_tp * vllm_tp} with --nproc-per-node {ranks}")
    if vllm_gpus is not None and vllm_gpus % vllm_tp == 0 and 1 <= num_gpus - vllm_gpus < ranks:
        fits.append(f"--vllm-gpus {vllm_gpus} with --nproc-per-node {num_gpus - vllm_gpus}")
    if not fits:
        tp = vllm_tp if num_gpus > vllm_tp else 1
        fits.append(f"--vllm-gpus {tp} --vllm-tp {tp} with --nproc-per-node {num_gpus - tp}")
    fits = " or ".join(fits)
    if vllm_gpus is None:
        if free < vllm_tp:
            raise ValueError(
                f"{ranks} trainer rank(s) leave {max(free, 0)} of {num_gpus} GPUs for vLLM servers "
                f"(one needs {vllm_tp}); try {fits}"
            )
        vllm_gpus = free // vllm_tp * vllm_tp
    if vllm_gpus % vllm_tp:
        raise ValueError(f"--vllm-gpus {vllm_gpus} is not a multiple of --vllm-tp {vllm_tp}; try {fits}")
    if vllm_gpus + ranks > num_gpus:
        raise ValueError(
            f"layout does not fit: {vllm_gpus} server GPU(s) + {ranks} trainer rank(s) > {num_gpus} GPUs "
            f"visible; try {fits}"
        )
    servers = [",".join(str(g) for g in range(i, i + vllm_tp)) for i in range(0, vllm_gpus, vllm_tp)]
    return servers, [f"cuda:{vllm_gpus + r}" for r in range(ranks)]


def describe_plan(num_gpus: int, servers: list[str], rank_devices: list[str]) -> str:
    """The one start-up line: where each server and each rank runs."""
    where = "none launched (--vllm-url)"
    if servers:
        where = "the CPU" if num_gpus == 0 else "GPU " + " | ".join(servers)
    ranks = ", ".join(f"rank {r} → {d}" for r, d in enumerate(rank_devices))
    return f"device plan ({num_gpus} GPU(s) visible): vLLM servers on {where}; trainer {ranks}"


def init_distributed(first_gpu: int, timeout_s: float) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun (WORLD_SIZE > 1) joins the default group: nccl on GPU,
    gloo on CPU. Rank r trains on GPU first_gpu + r (launched servers take GPUs 0..first_gpu−1).
    `timeout_s` bounds every collective, so it must cover rank 0's longest lone stretch (server
    start-up, a batch wait, an evaluation) during which the other ranks wait for its broadcast."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{first_gpu + local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return rank, world_size, device


def shard_model(model, compute_dtype: str = "fp32") -> None:
    """FSDP2: each decoder layer is a unit (its weights gathered for its forward, freed after), the
    root holds the rest (embeddings, final norm, lm_head). Parameter names are unchanged, and each
    parameter becomes a DTensor sharded on dim 0 over the ranks. With bf16 compute the shards stay in
    their dtype (fp32 masters), the gathered weights are bf16 and gradients are reduced in fp32."""
    policy = MixedPrecisionPolicy()
    if compute_dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def broadcast_message(message, world_size: int):
    """Rank 0's `message` (plain Python: lists, dicts, numbers) on every rank, pickled."""
    if world_size == 1:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_micro_batches(
    seqs: list[dict], bins: list[list[int]], rank: int, world_size: int
) -> list[list[dict]]:
    """This rank's micro-batches: bins[rank::world_size], padded to the same count on every rank (FSDP
    runs collectives in every forward and backward) with a copy of the last bin whose loss mask is all
    zero: it contributes zero loss and zero gradient."""
    mine = [[seqs[i] for i in b] for b in bins[rank::world_size]]
    filler = [{**seqs[i], "mask": [0] * len(seqs[i]["mask"])} for i in bins[-1]]
    return mine + [filler] * (-(-len(bins) // world_size) - len(mine))


def reduce_over_ranks(sums: dict[str, float], maxima: dict[str, float], world_size: int, device):
    """Sums and maxima of per-rank metrics (same keys on every rank)."""
    if world_size == 1:
        return sums, maxima
    for d, op in ((sums, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
        keys = sorted(d)
        t = torch.tensor([d[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        d.update(zip(keys, t.tolist()))
    return sums, maxima


# ---------------------------------------------------------------------------------------------------
# CHECKPOINTS: temp dir + rename, so a kill -9 leaves either the old or the new one
# ---------------------------------------------------------------------------------------------------
def save_checkpoint(
    out_dir: Path, model, tokenizer, optimizer, scheduler, state: dict, rank: int = 0
) -> Path:
    """Model in save_pretrained form, optimizer state keyed by parameter name (the same files for any
    number of ranks). Under FSDP every rank calls this (the full state is gathered to rank 0's CPU) and
    only rank 0 writes."""
    final = out_dir / "checkpoints" / f"step_{state['step']:06d}"
    if dist.is_initialized():
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=opts)  # {} on ranks other than 0
        optim = get_optimizer_state_dict(model, optimizer, options=opts)
    else:
        weights, optim = None, get_optimizer_state_dict(model, optimizer)
    if rank != 0:
        return final
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(
        {"optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rng, **state},
        tmp / "trainer_state.pt",
    )
    if final.exists():  # re-saving the same step (e.g. after a resume that trained nothing)
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = sorted((out_dir / "checkpoints").glob("step_*"))
    return ckpts[-1] if ckpts else None


def param_checksum(named_tensors) -> float:
    """A float fingerprint of the weights (sum of |w| · (k+1) over sorted names) for resume checks."""
    total = 0.0
    for k, (_, t) in enumerate(sorted(named_tensors, key=lambda kv: kv[0])):
        total += float(t.detach().double().abs().sum()) * (k + 1)
    return total


def lr_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


# ---------------------------------------------------------------------------------------------------
# LOGGING: metrics.jsonl always; a tracker only when asked and installed
# ---------------------------------------------------------------------------------------------------
class NoTracker:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class TensorBoardTracker:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def finish(self) -> None:
        self.writer.close()


class ModuleTracker:  # wandb and trackio share init/log/finish
    def __init__(self, module, project: str, config: dict, name: str):
        self.module = module
        module.init(project=project, config=config, name=name)

    def log(self, metrics: dict, step: int) -> None:
        self.module.log(metrics, step=step)

    def finish(self) -> None:
        self.module.finish()


def make_tracker(report_to: str, out_dir: Path, config: dict):
    if report_to == "none":
        return NoTracker()
    try:
        if report_to == "tensorboard":
            return TensorBoardTracker(out_dir / "tensorboard")
        import importlib

        return ModuleTracker(importlib.import_module(report_to), "async-grpo", config, out_dir.name)
    except ImportError as e:
        print(f"--report-to {report_to}: not installed ({e}); logging to metrics.jsonl only", file=sys.stderr)
        return NoTracker()


LAG_BUCKETS = 4  # token-lag histogram: rollout/token_lag_0 .. _3, then rollout/token_lag_4plus


def rollout_metrics(
    groups, dropped: int, skipped: int, taken=None, version: int | None = None
) -> dict[str, float]:
    rewards = [r for g in groups for r in g.rewards]
    advs = [a for g in groups for a in g.advantages]
    comps = [c for g in groups for c in g.completions]
    t = torch.tensor(rewards)
    a = torch.tensor(advs)
    m = {
        "rollout/reward_mean": t.mean().item(),
        "rollout/reward_std": t.std(correction=0).item(),
        "rollout/reward_min": t.min().item(),
        "rollout/reward_max": t.max().item(),
        "rollout/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "rollout/advantage_mean": a.mean().item(),
        "rollout/advantage_std": a.std(correction=0).item(),
        "rollout/advantage_min": a.min().item(),
        "rollout/advantage_max": a.max().item(),
        "rollout/staleness_mean": sum(g.staleness for g in groups) / len(groups),
        "rollout/staleness_max": float(max(g.staleness for g in groups)),
        "rollout/dropped_stale": float(dropped),
        "rollout/skipped_equal_reward": float(skipped),
    }
    # group_metrics has a fixed key set: average the per-group means, add up the counts.
    sums = {"rollout/tool_failures", "rollout/tool_calls", "rollout/generated_tokens",
            "rollout/generation_s", "rollout/tool_s", "rollout/completions",
            "rollout/reward_timeouts"}  # fmt: skip
    for k in groups[0].metrics:
        vals = [g.metrics[k] for g in groups]
        m[k] = sum(vals) if k in sums else max(vals) if k.endswith("_max") else sum(vals) / len(vals)
    m["rollout/tool_failure_rate"] = m["rollout/tool_failures"] / max(1.0, m["rollout/tool_calls"])
    m["rollout/completion_len_min"] = float(min(len(c) for c in comps))
    versions = [c.model_versions for c in comps if c.turns]
    m["rollout/multi_version_frac"] = sum(v[0] != v[1] for v in versions) / max(1, len(versions))
    if taken is not None:  # length bias of what reaches the loss: trained vs every group taken off the queue
        admitted = [len(c) for g in taken for c in g.completions]
        m["rollout/admitted_completions"] = float(len(admitted))
        m["rollout/admitted_len_mean"] = sum(admitted) / max(1, len(admitted))
        m["rollout/trained_vs_admitted_len"] = m["rollout/completion_len_mean"] / max(
            1e-9, m["rollout/admitted_len_mean"]
        )
    if version is not None:  # per generated token: trainer version − oldest version of its turn (≥ true lag)
        lags = Counter()
        for c in comps:
            for turn in c.turns:
                lags[version - turn.model_versions[0]] += len(turn.generated_ids)
        n = max(1, sum(lags.values()))
        m["rollout/token_lag_mean"] = sum(k * v for k, v in lags.items()) / n
        m["rollout/token_lag_max"] = float(max(lags, default=0))
        for b in range(LAG_BUCKETS):
            m[f"rollout/token_lag_{b}"] = lags.get(b, 0) / n
        m[f"rollout/token_lag_{LAG_BUCKETS}plus"] = sum(v for k, v in lags.items() if k >= LAG_BUCKETS) / n
    return m


# A completions.jsonl row holds at most this many completion tokens (token arrays and "text"; the rest
# is counted in "tokens_dropped"), tool results of at most 1000 characters and prompt messages of at most
# 2000: with ≈ 50 bytes of JSON per token a row stays under ~250 KB.
MAX_LOGGED_TOKENS = 4096


def logged_completions(groups) -> list[tuple[int, int, int]]:
    """(group index, completion index, sequence index in batch_sequences) of the completions written to
    completions.jsonl: in each of the first two groups, the best- and the worst-rewarded completion (the
    contrast the group's advantages are made of; the first two when all rewards are equal)."""
    chosen, first_seq = [], 0
    for gi, g in enumerate(groups):
        if gi < 2:
            best = max(range(len(g.rewards)), key=lambda i: g.rewards[i])
            worst = min(range(len(g.rewards)), key=lambda i: g.rewards[i])
            for ci in [0, 1] if best == worst else [best, worst]:
                chosen.append((gi, ci, first_seq + ci))
        first_seq += len(g.completions)
    return chosen


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text, so that "".join(pieces) == decode(ids) for byte-level BPE (Qwen, Llama 3): a
    character split over several tokens goes whole to the token that completes it, the others get ""."""
    pieces, start = [], 0
    for k in range(len(ids)):
        text = tokenizer.decode(ids[start : k + 1], skip_special_tokens=False)
        if text.endswith("\ufffd") and k - start < 3:  # an incomplete UTF-8 character so far
            pieces.append("")
            continue
        pieces.append(text)
        start = k + 1
    return pieces


def tool_output_kinds(pieces: list[str], results: list[str]) -> str:
    """For the tokens a tool turn appended (rendered template suffix): "t" where a token's text overlaps
    a tool result, "c" (chat template: turn closer, role headers, <tool_response> tags) elsewhere. The
    template inserts each result verbatim, so its first occurrence after the previous one is where it
    landed; a result cut by the context budget matches as far as it goes."""
    text, spans, pos = "".join(pieces), [], 0
    for r in results:
        i = text.find(r[:64], pos) if r else -1
        if i < 0:  # cut by the context budget: the longest head of r that ends the text
            n = next((n for n in range(min(len(r), len(text) - pos), 0, -1) if text.endswith(r[:n])), 0)
            i = len(text) - n if n else -1
        if i < 0:
            continue
        n = 0
        while n < len(r) and i + n < len(text) and text[i + n] == r[n]:
            n += 1
        spans.append((i, i + n))
        pos = i + n
    kinds, start = [], 0
    for p in pieces:
        end = start + len(p)
        kinds.append("t" if any(a < max(end, start + 1) and start < b for a, b in spans) else "c")
        start = end
    return "".join(kinds)


def trajectory_record(
    group, index: int, step: int, tokenizer, trainer_logprobs: list[float] | None = None,
    is_cap: float = math.inf,
) -> dict:  # fmt: skip
    """One completions.jsonl row: what scripts/view_rollouts.py shows. The token arrays run over the
    completion (not the prompt), aligned with completion_ids: mask 1 = trained; kind "m" model-generated
    (trained), "t" tool output, "c" chat-template glue; behaviour_logprob μ (null off the mask);
    trainer_logprob π_old from the forward of the step that trained it (every token); is_weight the
    loss's min(π_old/μ, C) (null off the mask). `turns` give each turn's span: `generated` tokens, then
    `appended` ones (tool responses + next header)."""
    completion = group.completions[index]
    ids = completion.completion_ids[:MAX_LOGGED_TOKENS]
    n_prompt = len(group.prompt_ids)
    trainer = (trainer_logprobs or [])[n_prompt : n_prompt + len(ids)]
    trainer = trainer if len(trainer) == len(ids) else [None] * len(ids)
    pieces, kinds, turns, calls = [], [], [], []
    for t_index, t in enumerate(completion.turns):
        start = len(pieces)
        if start >= len(ids):
            break
        gen = token_pieces(tokenizer, list(t.generated_ids))
        app = token_pieces(tokenizer, list(t.appended_ids))
        pieces += gen + app
        kinds.append("m" * len(gen) + tool_output_kinds(app, [c.result for c in t.tool_calls]))
        turns.append({
            "start": start, "generated": len(gen), "appended": len(app),
            "model_versions": list(t.model_versions), "finish_reason": t.finish_reason,
            "generation_s": round(t.generation_s, 4), "tool_s": round(t.tool_s, 4),
        })  # fmt: skip
        calls += [
            {"name": c.name, "arguments": c.arguments, "result": c.result[:1000], "failed": c.failed,
             "duration_s": round(c.duration_s, 4), "turn": t_index}
            for c in t.tool_calls
        ]  # fmt: skip
    mask = completion.loss_mask[: len(ids)]
    mu = completion.behaviour_logprobs[: len(ids)]
    rnd = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "step": step,
        "question": group.row.get("question"),
        "answer": group.row.get("answer"),
        "text": tokenizer.decode(group.prompt_ids + ids, skip_special_tokens=False),
        "reward": completion.reward,
        "stop_reason": completion.stop_reason,
        "tool_calls": calls,
        "admitted_version": group.admitted_version,
        "row_index": group.row.get("_index"),
        "advantage": group.advantages[index],
        "completion_index": index,
        "staleness": getattr(group, "staleness", None),
        "model_versions": list(completion.model_versions),
        "prompt_tokens": n_prompt,
        "prompt_messages": [
            {"role": m.get("role"), "content": str(m.get("content"))[:2000]} for m in group.prompt_messages
        ],
        "turns": turns,
        "tokens": {
            "ids": ids,
            "pieces": pieces[: len(ids)],
            "mask": mask,
            "kind": "".join(kinds)[: len(ids)],
            "behaviour_logprob": [rnd(b) if m else None for b, m in zip(mu, mask)],
            "trainer_logprob": [rnd(p) for p in trainer],
            "is_weight": [
                rnd(min(math.exp(p - b), is_cap)) if m and p is not None else None
                for p, b, m in zip(trainer, mu, mask)
            ],
        },
        "tokens_dropped": len(completion) - len(ids),
    }


async def evaluate(
    urls, model_name, template, make_episode, rows, args, expected_version
) -> dict[str, float]:
    """Greedy (temperature 0) rollouts of held-out rows with the same tool loop as training."""
    client = VLLMClient(
        urls,
        model_name,
        max_inflight=32,
        request_timeout_s=args.batch_timeout,
        expected_version=expected_version,
    )
    await client.open()
    ctx = RolloutContext(
        client=client, template=template, sampling=Sampling(temperature=0.0).request_fields(),
        max_turns=args.max_turns, max_calls_per_turn=args.max_calls_per_turn,
        max_context=args.max_context, version=lambda: 0,
        tool_semaphore=asyncio.Semaphore(args.sandbox_workers),
    )  # fmt: skip

    async def one(row):
        ep = make_episode(row)
        comp = await tool_loop_rollout(ctx, ep, template.prompt_ids(ep.messages))
        # Off the event loop: a reward check may take up to envs.verify.DEADLINE_S.
        reward = await asyncio.to_thread(ep.reward, comp.messages, comp.tool_calls)
        return float(reward), len(comp.tool_calls), getattr(ep, "reward_timeouts", 0)

    try:
        results = await asyncio.gather(*(one(r) for r in rows), return_exceptions=True)
    finally:
        await client.close()
    ok = [r for r in results if not isinstance(r, BaseException)]
    if not ok:
        return {"eval/accuracy": float("nan"), "eval/tool_call_rate": float("nan"), "eval/failed": len(rows)}
    return {
        "eval/accuracy": sum(r >= 1.0 for r, _, _ in ok) / len(ok),
        "eval/tool_call_rate": sum(n > 0 for _, n, _ in ok) / len(ok),
        "eval/tool_calls_per_completion": sum(n for _, n, _ in ok) / len(ok),
        "eval/failed": float(len(rows) - len(ok)),
        "eval/reward_timeouts": float(sum(t for _, _, t in ok)),
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


def probe_fidelity(urls, model_name, model, prompts, args, world_size, device) -> dict[str, float]:
    """Before the first step every server samples a few short completions with the run's settings, and
    the trainer re-scores them; FidelityError (naming the server, the gap and the likely causes) when they
    disagree. Under FSDP every rank joins the re-scoring forwards."""
    bf16 = args.compute_dtype == "bf16"  # and the servers then run bf16 too: a looser, KL bound
    worst: dict[str, float] = {}
    for url in urls:
        run, bare = asyncio.run(probe_server(url, model_name, prompts, sampling_of(args), args.seed))
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


def served_model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def sync_weights(syncer, model, version: int, world_size: int = 1, urls: list[str] | None = None) -> dict:
    """Push the trainer's weights into every joined server (or those of `urls`), tagged with `version`
    (the one call site). Rank 0 first tells the other ranks to join the gathers of the FSDP shards."""
    if syncer.rank == 0:
        broadcast_message({"sync": version}, world_size)
    metrics = syncer.sync(model.named_parameters(), version=version, urls=urls)
    return {k: float(v) for k, v in metrics.items() if k.startswith("sync/")}


def follow_rank0(model, ref_model, optimizer, scheduler, tokenizer, args, out_dir, rank, world_size, device):
    """Ranks other than 0: do what rank 0's messages say (train on a batch, join the gathers of a weight
    sync or a checkpoint) until it says stop. They never see a server, a queue or a metric."""
    from weight_sync import WeightSyncer

    syncer = WeightSyncer([], backend="nccl" if device.type == "cuda" else "gloo", rank=rank)  # gathers only
    while True:
        message = broadcast_message(None, world_size)
        if "batch" in message:
            train_step(
                model, ref_model, optimizer, scheduler, message["batch"], args, rank, world_size, device
            )
        elif "sync" in message:
            sync_weights(syncer, model, message["sync"])
        elif "rescore" in message:
            rescore(model, message["rescore"], device, args.compute_dtype == "bf16")
        elif "save" in message:
            save_checkpoint(out_dir, model, tokenizer, optimizer, scheduler, message["save"], rank)
        else:  # {"stop": True}
            return


def main(argv: list[str] | None = None) -> None:
    args = parser.parse_args(argv)
    verify.DEADLINE_S = args.reward_timeout
    check_args(args)
    from weight_sync import WeightSyncer, WeightSyncError  # imports vLLM: seconds, so not for --help

    # -----------------------------------------------------------------------------------------------
    # SETUP
    # -----------------------------------------------------------------------------------------------
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = None
    if args.resume is not None:
        ckpt = latest_checkpoint(out_dir) if args.resume == "latest" else Path(args.resume)
        if ckpt is None:
            parser.error(f"--resume: no checkpoint in {out_dir / 'checkpoints'}")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.rollout_cpus is not None:
        # The rollout thread and the tool/reward processes go to these CPUs (pin_to_rollout_cpus),
        # the trainer and its threads to the rest, so rollouts do not slow the trainer's steps.
        rollout_cpus, allowed = parse_cpus(args.rollout_cpus), os.sched_getaffinity(0)
        try:  # may this process run there at all (a container's cpuset)?
            os.sched_setaffinity(0, rollout_cpus)
        except OSError as e:
            parser.error(f"--rollout-cpus {args.rollout_cpus}: cannot run there ({e})")
        os.sched_setaffinity(0, allowed - rollout_cpus or allowed)
        os.environ[ROLLOUT_CPUS_ENV] = args.rollout_cpus
    on_gpu = torch.cuda.is_available()
    args.compute_dtype = args.compute_dtype or ("bf16" if on_gpu else "fp32")
    # Checked before anything starts: launched servers take GPUs 0..K−1, trainer rank r GPU K + r.
    num_gpus = torch.cuda.device_count() if on_gpu else 0
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    try:
        server_gpus, rank_devices = plan_devices(
            num_gpus, ranks, args.vllm_gpus, args.vllm_tp, not args.vllm_url,
            node_rank=int(os.environ.get("GROUP_RANK", 0)),  # torchrun's node rank
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    first_gpu = int(rank_devices[0].removeprefix("cuda:")) if on_gpu else 0
    rank, world_size, device = init_distributed(first_gpu, args.server_timeout + 3 * args.batch_timeout)
    if rank == 0:
        print(
            describe_plan(num_gpus, server_gpus, rank_devices) + f"; compute {args.compute_dtype}", flush=True
        )

    env = load_env(args.env)
    make_episode = env.make_episode
    sandbox_mode = {}  # logged once, in the first step's metrics line
    if "sandbox" in inspect.signature(env.make_episode).parameters:
        from envs.sandbox import Sandbox, isolation_gaps, isolation_mode

        sandbox_mode = {"sandbox/mode": isolation_mode()}
        if rank == 0:
            print(f"sandbox isolation: {isolation_mode()}", flush=True)
        if isolation_gaps() and not args.unsafe_sandbox:
            sys.exit(
                f"sandbox isolation {isolation_mode()!r} cannot stop {', '.join(isolation_gaps())} here "
                "(it needs root with CAP_SYS_ADMIN, user namespaces, or seccomp with Landlock); "
                "pass --unsafe-sandbox to accept the risk"
            )
        make_episode = functools.partial(env.make_episode, sandbox=Sandbox(args.sandbox_workers))
    rows = load_rows(args.dataset)
    eval_rows = load_rows(args.eval_dataset, split="test")[: args.eval_limit] if args.eval_every else []

    tokenizer = AutoTokenizer.from_pretrained(ckpt or args.model)
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    template = ChatTemplate(tokenizer, tools=getattr(make_episode(rows[0]), "tools", None))
    # fp32 weights and optimizer state whatever the compute dtype (see train_step).
    model = AutoModelForCausalLM.from_pretrained(ckpt or args.model, dtype=torch.float32).to(device)
    model.train()
    if on_gpu:
        model.gradient_checkpointing_enable()
    loaded_checksum = param_checksum(model.named_parameters()) if ckpt is not None else None
    ref_model = None
    if args.kl_beta > 0:
        ref_dtype = torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32  # frozen: no masters
        ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=ref_dtype).to(device).eval()
        ref_model.requires_grad_(False)
    if world_size > 1:
        shard_model(model, args.compute_dtype)
        if ref_model is not None:
            shard_model(ref_model, args.compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.max_steps, args.lr_schedule)
    )
    step, version, position = 0, 0, 0
    if ckpt is not None:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        if world_size > 1:  # rank 0's copy, scattered into the shards
            set_optimizer_state_dict(
                model, optimizer, state["optimizer"] if rank == 0 else {},
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )  # fmt: skip
        else:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if on_gpu and "cuda" in state["rng"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        step, version, position = state["step"], state["model_version"], state["dataset_position"]
        print(
            f"resumed from {ckpt} at step {step}, model version {version}, dataset position {position} "
            f"(param checksum {loaded_checksum!r})",
            flush=True,
        )

    # Servers (launched here, or assumed of those given by --vllm-url) run bf16 on GPU, fp32 on CPU (the
    # CPU tests compare logprobs with the trainer's exactly).
    serving_dtype = "bfloat16" if on_gpu else "float32"
    servers, syncer, worker, tracker, bar = [], None, None, NoTracker(), None
    stop_flag = {"stop": False}
    refused, fidelity = False, {}
    signal.signal(signal.SIGTERM, lambda *_: stop_flag.update(stop=True))
    if world_size > 1:
        # Ctrl-C and SIGTERM stop rank 0 between two steps, never inside a collective; it then tells
        # the other ranks, which ignore both signals (torchrun SIGKILLs them if rank 0 dies).
        signal.signal(signal.SIGINT, lambda *_: stop_flag.update(stop=True))
    if rank != 0:
        follow_rank0(
            model, ref_model, optimizer, scheduler, tokenizer, args, out_dir, rank, world_size, device
        )
        dist.destroy_process_group()
        return
    last_saved = step
    metrics_file = open(out_dir / "metrics.jsonl", "a")
    completions_file = open(out_dir / "completions.jsonl", "a")
    state = lambda: {"step": step, "model_version": version, "dataset_position": position, "args": vars(args)}  # noqa: E731

    def save() -> Path:  # the other ranks join the gathers of the full state
        broadcast_message({"save": state()}, world_size)
        return save_checkpoint(out_dir, model, tokenizer, optimizer, scheduler, state())

    def write_servers_file() -> None:
        # Process groups of the servers: after a kill -9 of this script their engine processes can
        # outlive the API server; `kill -9 -PGID` cleans up.
        (out_dir / "vllm-logs" / "servers.json").write_text(
            json.dumps([{"url": s.url, "pgid": s.proc.pid} for s in servers])
        )

    def heal(push: bool = True) -> None:
        """Bring servers back into the run. Our own that exited are relaunched (same port, base
        weights). Any server that answers without our weights (restarted, or failed a sync) gets a new
        transfer group and, unless a sync to all follows at once (`push=False`), the current weights;
        the client routes to it again once it reports our version. A failure is retried next call."""
        for s in servers:
            if not s.alive():
                print(
                    f"vLLM server {s.url} exited with code {s.proc.returncode}; relaunching it",
                    file=sys.stderr,
                    flush=True,
                )
                s.restart()
                write_servers_file()
        stale = syncer.out_of_step()
        if not stale:
            return
        try:
            syncer.join(stale)
        except WeightSyncError as e:  # names a server that did not answer; those that did have joined
            print(f"weight-transfer group: {e}", file=sys.stderr, flush=True)
        stale = [u for u in stale if u in syncer.groups]
        if not stale:
            return
        try:
            if push:
                sync_weights(syncer, model, version, world_size, urls=stale)
        except WeightSyncError as e:
            print(f"could not bring {', '.join(stale)} back yet: {e}", file=sys.stderr, flush=True)
            return
        what = f"model version {version}" if push else "the next sync"
        print(f"{', '.join(stale)}: new weight-transfer group, gets {what}", file=sys.stderr, flush=True)

    try:
        # -------------------------------------------------------------------------------------------
        # START ROLLOUTS: servers, weight sync group, the worker thread
        # -------------------------------------------------------------------------------------------
        if args.vllm_url:
            urls = [u.rstrip("/") for u in args.vllm_url]
            model_name = served_model_name(urls[0])
        else:
            from vllm_server import start_vllm_servers

            servers = start_vllm_servers(
                args.model, num_servers=len(server_gpus), gpus_per_server=args.vllm_tp if on_gpu else 1,
                log_dir=out_dir / "vllm-logs", timeout_s=args.server_timeout, max_model_len=args.max_context,
                seed=args.seed, dtype=serving_dtype,
            )  # fmt: skip
            urls, model_name = [s.url for s in servers], str(args.model)
            write_servers_file()
        # From here Ctrl-C is deferred in every mode (as SIGTERM is): it stops the run between steps
        # (collect_groups raises KeyboardInterrupt), never inside an optimizer step, a weight sync or a
        # checkpoint write. Before this point (server start-up) there is nothing to leave half-done.
        signal.signal(signal.SIGINT, lambda *_: stop_flag.update(stop=True))
        # The fp32 masters are cast to the servers' dtype as they are sent (half the bytes on GPU).
        syncer = WeightSyncer(
            urls, backend="nccl" if on_gpu else "gloo", send_dtype=getattr(torch, serving_dtype),
            master_address=args.sync_host,
        )  # fmt: skip
        syncer.init()
        # Always push ours, even onto launched servers that hold the base model: servers given by
        # --vllm-url may hold anything, a checkpoint's weights must go in, and the version tag it sets
        # is how a restarted server (tag "default", base weights) is told apart from one in step.
        sync_weights(syncer, model, version, world_size)
        probe_prompts = [template.prompt_ids(make_episode(r).messages) for r in rows[:4]]
        fidelity = probe_fidelity(urls, model_name, model, probe_prompts, args, world_size, device)
        client = VLLMClient(
            urls, model_name, request_timeout_s=args.batch_timeout, expected_version=lambda: syncer.version
        )
        worker = AsyncRolloutWorker(
            client, template, make_episode, row_stream(rows, args.seed, position),
            num_generations=args.num_generations, groups_per_version=args.prompts_per_step * args.sync_every,
            max_staleness=args.max_staleness, max_turns=args.max_turns, max_context=args.max_context,
            max_calls_per_turn=args.max_calls_per_turn, sampling=sampling_of(args).request_fields(),
            seed=args.seed,
            max_concurrent_tools=args.sandbox_workers, scale_rewards=not args.no_scale_rewards,
            start_version=version,
        )  # fmt: skip
        if args.eval_every and step == 0:  # the starting point, before any rollout competes for the server
            t_eval = time.monotonic()
            start = asyncio.run(
                evaluate(urls, model_name, template, make_episode, eval_rows, args, client.expected_version)
            )
            start.update({"step": 0, "model_version": version, "perf/eval_s": time.monotonic() - t_eval})
            metrics_file.write(json.dumps(start) + "\n")
            metrics_file.flush()
            print(f"eval at start: {json.dumps(start)}", flush=True)
        worker.start()
        tracker = make_tracker(args.report_to, out_dir, vars(args))

        # -------------------------------------------------------------------------------------------
        # TRAIN LOOP
        # -------------------------------------------------------------------------------------------
        bar = tqdm(total=args.max_steps, initial=step, desc="grpo", dynamic_ncols=True)
        t_last, request_s = time.monotonic(), worker.stats.request_seconds
        while step < args.max_steps:
            groups, taken, dropped, skipped, wait_s = collect_groups(
                worker, args.prompts_per_step, version, args, urls, stop_flag, heal
            )
            position = max([position] + [g.row["_index"] + 1 for g in taken])

            # Every rank gets the batch and trains on its share of it (train_step).
            t_train = time.monotonic()
            version_trained = version  # the version the batch's lags are measured against
            seqs = batch_sequences(groups)
            # The completions logged this step carry a "trace" key: train_step returns their logprobs.
            logging = (step + 1) % args.log_completions_every == 0 or step == 0
            logged, traced = logged_completions(groups) if logging else [], {}
            for _, _, i in logged:
                seqs[i]["trace"] = i
            broadcast_message({"batch": seqs}, world_size)
            train = train_step(
                model, ref_model, optimizer, scheduler, seqs, args, rank, world_size, device, traced
            )
            step += 1
            train_s = time.monotonic() - t_train

            # Weight sync every --sync-every steps; the worker admits by the new version.
            # A server that fails is left out (named on stderr, counted) and brought back by `heal` once
            # it answers; the run stops only if no batch comes within --batch-timeout.
            sync = {"sync/seconds": 0.0, "sync/mb": 0.0, "sync/mb_per_s": 0.0, "sync/servers_failed": 0.0}
            if step % args.sync_every == 0:
                version += 1
                heal(push=False)
                try:
                    sync.update(sync_weights(syncer, model, version, world_size))
                except WeightSyncError as e:
                    print(f"\nstep {step}: {e}", file=sys.stderr, flush=True)
                sync["sync/servers_failed"] = float(len(syncer.failed))
                worker.set_version(version)

            # Metrics: one dict per step.
            now = time.monotonic()
            step_s, t_last = now - t_last, now
            metrics = {"step": step, "model_version": version, "dataset_position": position}
            metrics.update(rollout_metrics(groups, dropped, skipped, taken, version_trained))
            metrics.update(train)
            metrics.update(sync)
            metrics.update(fidelity)  # the start-up probe's gaps, on the first step's line
            fidelity = {}
            request_s, request_s_last = worker.stats.request_seconds, request_s
            metrics.update({
                "perf/requests_in_flight": (request_s - request_s_last) / step_s,
                "perf/step_s": step_s,
                "perf/wait_s": wait_s,
                "perf/idle_frac": wait_s / step_s,
                "perf/train_s": train_s,
                "perf/gen_tok_s": metrics["rollout/generated_tokens"] / step_s,
                "perf/train_tok_s": sum(len(s["ids"]) for s in seqs) / train_s,
                "perf/groups_failed": float(worker.stats.groups_failed),
                "perf/groups_retried": float(worker.stats.groups_retried),
                "perf/servers_down": float(len(worker.client.down)),
            })  # fmt: skip
            if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
                t_eval = time.monotonic()
                heal()
                metrics.update(
                    asyncio.run(
                        evaluate(
                            urls, model_name, template, make_episode, eval_rows, args, client.expected_version
                        )
                    )
                )
                metrics["perf/eval_s"] = time.monotonic() - t_eval
                t_last += metrics["perf/eval_s"]  # eval time is not the next step's
            metrics_file.write(json.dumps(metrics | sandbox_mode) + "\n")  # a string: not for the tracker
            sandbox_mode = {}
            metrics_file.flush()
            tracker.log(metrics, step)
            if logged:
                for gi, ci, i in logged:
                    row = trajectory_record(groups[gi], ci, step, tokenizer, traced.get(i), args.is_cap)
                    completions_file.write(json.dumps(row) + "\n")
                completions_file.flush()
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['rollout/reward_mean']:.3f}", acc=f"{metrics['rollout/accuracy']:.2f}",
                gen_tok_s=f"{metrics['perf/gen_tok_s']:.0f}",
                train_tok_s=f"{metrics['perf/train_tok_s']:.0f}",
            )  # fmt: skip
            if step % args.save_every == 0:
                save()
                last_saved = step
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {step}; saving a final checkpoint", file=sys.stderr, flush=True)
    except FidelityError as e:  # before the first step: nothing to save, one line to read
        print(f"refusing to train: {e}", file=sys.stderr, flush=True)
        refused = True
    except WeightSyncError as e:  # the servers could not join the transfer groups: one line, exit 1
        print(f"weight sync: {e}", file=sys.stderr, flush=True)
        refused = True
    finally:
        # -------------------------------------------------------------------------------------------
        # SHUTDOWN: stop admitting → stop the worker → release the sync group → stop the servers
        # -------------------------------------------------------------------------------------------
        exc = sys.exc_info()[1]
        if bar is not None:
            bar.close()
        if worker is not None:
            worker.stop(timeout_s=10.0)
            ws, cs = worker.stats, worker.client.stats
            print(
                f"rollout counters: groups started {ws.groups_started}, done {ws.groups_done}, retried "
                f"{ws.groups_retried}, failed {ws.groups_failed}, discarded {ws.groups_discarded}; "
                f"servers taken out {cs.servers_down}, back {cs.servers_readmitted}; "
                f"requests {cs.requests}, retries {cs.retries}",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        # A batch that never came or a failed weight sync strikes between steps, when the model and
        # optimizer are whole: save, like an interrupted run. An exception mid-step saves nothing.
        between_steps = exc is None or isinstance(exc, (KeyboardInterrupt, BatchTimeout))
        if between_steps and exc is not None and not isinstance(exc, KeyboardInterrupt):
            print(f"\nstopping at step {step}: {exc}", file=sys.stderr, flush=True)
        if step > last_saved and between_steps:
            path = save()
            print(f"saved {path}", flush=True)
        if world_size > 1 and between_steps:  # the other ranks wait for a message: release them
            broadcast_message({"stop": True}, world_size)
        if syncer is not None:
            syncer.close()
        for s in servers:
            s.stop()
        tracker.finish()
        metrics_file.close()
        completions_file.close()
        if world_size > 1:
            dist.destroy_process_group()
    if refused:
        sys.exit(1)


if __name__ == "__main__":
    main()
