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
import functools
import inspect
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from batches import BatchTimeout, batch_sequences, collate, collect_groups, pack, row_stream
from checkpoint import latest_checkpoint, load_checkpoint, param_checksum, save_checkpoint
from distributed import (
    broadcast_message,
    gather_traced,
    place_ranks,
    rank_micro_batches,
    reduce_over_ranks,
    shard_model,
)
from envs import ENVS, load_env, verify
from envs.confine import ROLLOUT_CPUS_ENV, parse_cpus
from envs.data import load_rows
from evaluate import evaluate
from loss import grpo_loss
from metrics import (
    NoTracker,
    keep_traced,
    logged_completions,
    make_tracker,
    perf_metrics,
    rollout_metrics,
    write_completions,
)
from rollout import (
    AsyncRolloutWorker,
    ChatTemplate,
    VLLMClient,
)
from sampling import FidelityError, Sampling, probe_fidelity, rescore, token_logprobs
from vllm_server import relaunch_exited, served_model_name, write_servers_file

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


# ---------------------------------------------------------------------------------------------------
# RANKS: rank 0 runs the loop and sends each step's work as a message; the others follow it
# ---------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------
# SET-UP STEPS: each reads the arguments it names and returns what the run holds
# ---------------------------------------------------------------------------------------------------
def checkpoint_to_resume(resume: str | None, out_dir: Path) -> Path | None:
    """--resume: the checkpoint it names, or (no value) the latest in --output-dir; None without it."""
    if resume is None:
        return None
    ckpt = latest_checkpoint(out_dir) if resume == "latest" else Path(resume)
    if ckpt is None:
        parser.error(f"--resume: no checkpoint in {out_dir / 'checkpoints'}")
    return ckpt


def pin_rollout_cpus(args: argparse.Namespace) -> None:
    """--rollout-cpus: the rollout thread and the tool/reward processes go to these CPUs
    (envs.confine.pin_to_rollout_cpus), the trainer and its threads to the rest, so rollouts do not slow
    the trainer's steps."""
    if args.rollout_cpus is None:
        return
    rollout_cpus, allowed = parse_cpus(args.rollout_cpus), os.sched_getaffinity(0)
    try:  # may this process run there at all (a container's cpuset)?
        os.sched_setaffinity(0, rollout_cpus)
    except OSError as e:
        parser.error(f"--rollout-cpus {args.rollout_cpus}: cannot run there ({e})")
    os.sched_setaffinity(0, allowed - rollout_cpus or allowed)
    os.environ[ROLLOUT_CPUS_ENV] = args.rollout_cpus


def episode_maker(args: argparse.Namespace, rank: int):
    """(make_episode, the sandbox/ line of the first step's metrics). An env whose episodes run tools
    gets a sandbox; a sandbox that cannot confine them here stops the run unless --unsafe-sandbox."""
    env = load_env(args.env)
    if "sandbox" not in inspect.signature(env.make_episode).parameters:
        return env.make_episode, {}
    from envs.sandbox import Sandbox, isolation_gaps, isolation_mode

    if rank == 0:
        print(f"sandbox isolation: {isolation_mode()}", flush=True)
    if isolation_gaps() and not args.unsafe_sandbox:
        sys.exit(
            f"sandbox isolation {isolation_mode()!r} cannot stop {', '.join(isolation_gaps())} here "
            "(it needs root with CAP_SYS_ADMIN, user namespaces, or seccomp with Landlock); "
            "pass --unsafe-sandbox to accept the risk"
        )
    make_episode = functools.partial(env.make_episode, sandbox=Sandbox(args.sandbox_workers))
    return make_episode, {"sandbox/mode": isolation_mode()}


def load_models(args: argparse.Namespace, ckpt: Path | None, device: torch.device, world_size: int):
    """(model, frozen reference model or None, param checksum of the loaded checkpoint or None).
    fp32 weights and optimizer state whatever the compute dtype (see train_step); FSDP2 over ranks."""
    model = AutoModelForCausalLM.from_pretrained(ckpt or args.model, dtype=torch.float32).to(device)
    model.train()
    if device.type == "cuda":
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
    return model, ref_model, loaded_checksum


def load_tokenizer(args: argparse.Namespace, ckpt: Path | None, episode) -> tuple[object, ChatTemplate]:
    """(tokenizer, chat template): the checkpoint's or the model's tokenizer, --chat-template if given,
    and the tools of `episode` (an env's tools are the same for every row)."""
    tokenizer = AutoTokenizer.from_pretrained(ckpt or args.model)
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    return tokenizer, ChatTemplate(tokenizer, tools=getattr(episode, "tools", None))


def lr_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def make_optimizer(model, args: argparse.Namespace):
    """AdamW over the (fp32) parameters and its --lr-schedule after --warmup-steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.max_steps, args.lr_schedule)
    )
    return optimizer, scheduler


# ---------------------------------------------------------------------------------------------------
# THE RUN (rank 0): what the loop advances, and what a checkpoint, a heal and the shutdown need
# ---------------------------------------------------------------------------------------------------
@dataclass
class Run:
    args: argparse.Namespace
    out_dir: Path
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    world_size: int
    step: int  # optimizer steps taken
    version: int  # weight syncs done: the servers' weight-version tag
    position: int  # dataset stream position just after the last row taken off the queue
    stop_flag: dict  # {"stop": True} once SIGINT or SIGTERM came: the loop stops between steps
    last_saved: int = 0  # step of the newest checkpoint (or of the resume)
    metrics_file: object = None  # metrics.jsonl, appended to
    completions_file: object = None  # completions.jsonl (the rollout viewer's rows), appended to
    tracker: object = field(default_factory=NoTracker)
    bar: object = None  # the tqdm progress bar
    servers: list = field(default_factory=list)  # launched here; none with --vllm-url
    syncer: object = None  # weight_sync.WeightSyncer, once the servers are up
    worker: object = None  # rollout.AsyncRolloutWorker, once the servers are up


def save(run: Run) -> Path:
    """A checkpoint of the current step; the other ranks join the gathers of the full state."""
    state = {"step": run.step, "model_version": run.version, "dataset_position": run.position}
    state["args"] = vars(run.args)
    broadcast_message({"save": state}, run.world_size)
    return save_checkpoint(run.out_dir, run.model, run.tokenizer, run.optimizer, run.scheduler, state)


def heal(run: Run, push: bool = True) -> None:
    """Bring servers back into the run. Our own that exited are relaunched (same port, base weights).
    Any server that answers without our weights (restarted, or failed a sync) gets a new transfer group
    and, unless a sync to all follows at once (`push=False`), the current weights; the client routes to
    it again once it reports our version. A failure is retried next call."""
    from weight_sync import WeightSyncError

    relaunch_exited(run.servers, run.out_dir / "vllm-logs" / "servers.json")
    stale = run.syncer.rejoin()
    if not stale:
        return
    try:
        if push:
            sync_weights(run.syncer, run.model, run.version, run.world_size, urls=stale)
    except WeightSyncError as e:
        print(f"could not bring {', '.join(stale)} back yet: {e}", file=sys.stderr, flush=True)
        return
    what = f"model version {run.version}" if push else "the next sync"
    print(f"{', '.join(stale)}: new weight-transfer group, gets {what}", file=sys.stderr, flush=True)


def start_rollouts(
    run: Run, server_gpus: list[str], template: ChatTemplate, make_episode, rows: list[dict], device
) -> tuple[list[str], str, dict[str, float]]:
    """Servers up (those of --vllm-url, or launched here on `server_gpus`), the weight-transfer group
    formed, our weights pushed, the fidelity probe passed, the rollout worker built (not started).
    Returns (server URLs, the model name they serve, the probe's gaps)."""
    from weight_sync import WeightSyncer  # imports vLLM: seconds

    args, on_gpu = run.args, torch.cuda.is_available()
    # Servers (launched here, or assumed of those given by --vllm-url) run bf16 on GPU, fp32 on CPU (the
    # CPU tests compare logprobs with the trainer's exactly).
    serving_dtype = "bfloat16" if on_gpu else "float32"
    if args.vllm_url:
        urls = [u.rstrip("/") for u in args.vllm_url]
        model_name = served_model_name(urls[0])
    else:
        from vllm_server import start_vllm_servers

        run.servers = start_vllm_servers(
            args.model, num_servers=len(server_gpus), gpus_per_server=args.vllm_tp if on_gpu else 1,
            log_dir=run.out_dir / "vllm-logs", timeout_s=args.server_timeout, max_model_len=args.max_context,
            seed=args.seed, dtype=serving_dtype,
        )  # fmt: skip
        urls, model_name = [s.url for s in run.servers], str(args.model)
        write_servers_file(run.servers, run.out_dir / "vllm-logs" / "servers.json")
    # From here Ctrl-C is deferred in every mode (as SIGTERM is): it stops the run between steps
    # (collect_groups raises KeyboardInterrupt), never inside an optimizer step, a weight sync or a
    # checkpoint write. Before this point (server start-up) there is nothing to leave half-done.
    signal.signal(signal.SIGINT, lambda *_: run.stop_flag.update(stop=True))
    # The fp32 masters are cast to the servers' dtype as they are sent (half the bytes on GPU).
    run.syncer = WeightSyncer(
        urls, backend="nccl" if on_gpu else "gloo", send_dtype=getattr(torch, serving_dtype),
        master_address=args.sync_host,
    )  # fmt: skip
    run.syncer.init()
    # Always push ours, even onto launched servers that hold the base model: servers given by
    # --vllm-url may hold anything, a checkpoint's weights must go in, and the version tag it sets
    # is how a restarted server (tag "default", base weights) is told apart from one in step.
    sync_weights(run.syncer, run.model, run.version, run.world_size)
    probe_prompts = [template.prompt_ids(make_episode(r).messages) for r in rows[:4]]
    bf16 = args.compute_dtype == "bf16"  # and the servers then run bf16 too: a looser, KL bound
    fidelity = probe_fidelity(
        urls, model_name, run.model, probe_prompts, sampling_of(args), args.seed, bf16, run.world_size, device
    )
    client = VLLMClient(
        urls, model_name, request_timeout_s=args.batch_timeout, expected_version=lambda: run.syncer.version
    )
    run.worker = AsyncRolloutWorker(
        client, template, make_episode, row_stream(rows, args.seed, run.position),
        num_generations=args.num_generations, groups_per_version=args.prompts_per_step * args.sync_every,
        max_staleness=args.max_staleness, max_turns=args.max_turns, max_context=args.max_context,
        max_calls_per_turn=args.max_calls_per_turn, sampling=sampling_of(args).request_fields(),
        seed=args.seed,
        max_concurrent_tools=args.sandbox_workers, scale_rewards=not args.no_scale_rewards,
        start_version=run.version,
    )  # fmt: skip
    return urls, model_name, fidelity


# ---------------------------------------------------------------------------------------------------
# LOOP STEPS
# ---------------------------------------------------------------------------------------------------
def mark_logged(groups, seqs: list[dict], step: int, every: int) -> list[tuple[int, int, int]]:
    """The completions written to completions.jsonl this step (every `every` steps and the first one);
    their sequences get a "trace" key, so that train_step returns their logprobs."""
    logged = logged_completions(groups) if (step + 1) % every == 0 or step == 0 else []
    for _, _, i in logged:
        seqs[i]["trace"] = i
    return logged


def sync_if_due(run: Run) -> dict[str, float]:
    """Every --sync-every steps: a new model version, pushed into the servers; the worker admits by it.
    A server that fails is left out (named on stderr, counted) and brought back by `heal` once it
    answers; the run stops only if no batch comes within --batch-timeout."""
    from weight_sync import WeightSyncError

    sync = {"sync/seconds": 0.0, "sync/mb": 0.0, "sync/mb_per_s": 0.0, "sync/servers_failed": 0.0}
    if run.step % run.args.sync_every == 0:
        run.version += 1
        heal(run, push=False)
        try:
            sync.update(sync_weights(run.syncer, run.model, run.version, run.world_size))
        except WeightSyncError as e:
            print(f"\nstep {run.step}: {e}", file=sys.stderr, flush=True)
        sync["sync/servers_failed"] = float(len(run.syncer.failed))
        run.worker.set_version(run.version)
    return sync


def log_step(run: Run, metrics: dict, text_fields: dict, groups, logged, traced: dict) -> None:
    """One metrics.jsonl line (with `text_fields`, which the tracker does not take), the tracker, the
    progress bar, and the rollout viewer's rows of the completions logged this step."""
    run.metrics_file.write(json.dumps(metrics | text_fields) + "\n")
    run.metrics_file.flush()
    run.tracker.log(metrics, run.step)
    if logged:
        write_completions(
            run.completions_file, groups, logged, traced, run.step, run.tokenizer, run.args.is_cap
        )
    run.bar.update(1)
    run.bar.set_postfix(
        reward=f"{metrics['rollout/reward_mean']:.3f}", acc=f"{metrics['rollout/accuracy']:.2f}",
        gen_tok_s=f"{metrics['perf/gen_tok_s']:.0f}",
        train_tok_s=f"{metrics['perf/train_tok_s']:.0f}",
    )  # fmt: skip


def shutdown(run: Run, exc: BaseException | None) -> None:
    """Stop the worker → final checkpoint (also after a batch timeout, which strikes between steps; not
    after an exception mid-step) → release the other ranks and the sync group → stop the servers."""
    if run.bar is not None:
        run.bar.close()
    if run.worker is not None:
        run.worker.stop(timeout_s=10.0)
        ws, cs = run.worker.stats, run.worker.client.stats
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
        print(f"\nstopping at step {run.step}: {exc}", file=sys.stderr, flush=True)
    if run.step > run.last_saved and between_steps:
        print(f"saved {save(run)}", flush=True)
    if run.world_size > 1 and between_steps:  # the other ranks wait for a message: release them
        broadcast_message({"stop": True}, run.world_size)
    if run.syncer is not None:
        run.syncer.close()
    for s in run.servers:
        s.stop()
    run.tracker.finish()
    run.metrics_file.close()
    run.completions_file.close()
    if run.world_size > 1:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parser.parse_args(argv)
    verify.DEADLINE_S = args.reward_timeout
    check_args(args)

    # -----------------------------------------------------------------------------------------------
    # SETUP
    # -----------------------------------------------------------------------------------------------
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint_to_resume(args.resume, out_dir)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    pin_rollout_cpus(args)
    args.compute_dtype = args.compute_dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    try:  # checked before anything starts: launched servers take GPUs 0..K−1, trainer rank r GPU K + r
        server_gpus, rank, world_size, device = place_ranks(
            args.vllm_gpus, args.vllm_tp, not args.vllm_url, args.compute_dtype,
            collective_timeout_s=args.server_timeout + 3 * args.batch_timeout,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    make_episode, sandbox_mode = episode_maker(args, rank)  # sandbox_mode: logged on the first step
    rows = load_rows(args.dataset)
    eval_rows = load_rows(args.eval_dataset, split="test")[: args.eval_limit] if args.eval_every else []
    tokenizer, template = load_tokenizer(args, ckpt, make_episode(rows[0]))
    model, ref_model, loaded_checksum = load_models(args, ckpt, device, world_size)
    optimizer, scheduler = make_optimizer(model, args)
    step, version, position = 0, 0, 0
    if ckpt is not None:
        step, version, position = load_checkpoint(ckpt, model, optimizer, scheduler, rank, world_size)
        print(
            f"resumed from {ckpt} at step {step}, model version {version}, dataset position {position} "
            f"(param checksum {loaded_checksum!r})",
            flush=True,
        )
    stop_flag = {"stop": False}
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
    run = Run(
        args, out_dir, model, tokenizer, optimizer, scheduler, world_size, step, version, position, stop_flag,
        last_saved=step, metrics_file=open(out_dir / "metrics.jsonl", "a"),
        completions_file=open(out_dir / "completions.jsonl", "a"),
    )  # fmt: skip
    from weight_sync import WeightSyncError  # imports vLLM: seconds, so not for --help

    refused = False
    try:
        # -------------------------------------------------------------------------------------------
        # START ROLLOUTS: servers, weight sync group, fidelity probe, the worker thread
        # -------------------------------------------------------------------------------------------
        urls, model_name, fidelity = start_rollouts(run, server_gpus, template, make_episode, rows, device)
        expected_version = run.worker.client.expected_version
        eval_args = (urls, model_name, template, make_episode, eval_rows, args, expected_version)
        if args.eval_every and run.step == 0:  # the start, before any rollout competes for the server
            t_eval = time.monotonic()
            start = asyncio.run(evaluate(*eval_args))
            start.update({"step": 0, "model_version": run.version, "perf/eval_s": time.monotonic() - t_eval})
            run.metrics_file.write(json.dumps(start) + "\n")
            run.metrics_file.flush()
            print(f"eval at start: {json.dumps(start)}", flush=True)
        run.worker.start()
        run.tracker = make_tracker(args.report_to, out_dir, vars(args))

        # -------------------------------------------------------------------------------------------
        # TRAIN LOOP
        # -------------------------------------------------------------------------------------------
        run.bar = tqdm(total=args.max_steps, initial=run.step, desc="grpo", dynamic_ncols=True)
        t_last, request_s = time.monotonic(), run.worker.stats.request_seconds
        while run.step < args.max_steps:
            groups, taken, dropped, skipped, wait_s = collect_groups(
                run.worker, args.prompts_per_step, run.version, args, urls, stop_flag,
                functools.partial(heal, run),
            )  # fmt: skip
            run.position = max([run.position] + [g.row["_index"] + 1 for g in taken])

            # Every rank gets the batch and trains on its share of it (train_step).
            t_train = time.monotonic()
            version_trained = run.version  # the version the batch's lags are measured against
            seqs = batch_sequences(groups)
            logged, traced = mark_logged(groups, seqs, run.step, args.log_completions_every), {}
            broadcast_message({"batch": seqs}, world_size)
            train = train_step(
                model, ref_model, optimizer, scheduler, seqs, args, rank, world_size, device, traced
            )
            run.step += 1
            train_s = time.monotonic() - t_train
            sync = sync_if_due(run)

            # Metrics: one dict per step.
            now = time.monotonic()
            step_s, t_last = now - t_last, now
            metrics = {"step": run.step, "model_version": run.version, "dataset_position": run.position}
            metrics.update(rollout_metrics(groups, dropped, skipped, taken, version_trained))
            metrics.update(train | sync | fidelity)  # fidelity: the start-up probe's gaps, first line only
            request_s, request_s_last, fidelity = run.worker.stats.request_seconds, request_s, {}
            metrics.update(perf_metrics(
                run.worker, request_s - request_s_last, step_s, wait_s, train_s, seqs,
                metrics["rollout/generated_tokens"],
            ))  # fmt: skip
            if args.eval_every and (run.step % args.eval_every == 0 or run.step == args.max_steps):
                t_eval = time.monotonic()
                heal(run)
                metrics.update(asyncio.run(evaluate(*eval_args)))
                metrics["perf/eval_s"] = time.monotonic() - t_eval
                t_last += metrics["perf/eval_s"]  # eval time is not the next step's
            log_step(run, metrics, sandbox_mode, groups, logged, traced)  # sandbox_mode: a string
            sandbox_mode = {}
            if run.step % args.save_every == 0:
                save(run)
                run.last_saved = run.step
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {run.step}; saving a final checkpoint", file=sys.stderr, flush=True)
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
        shutdown(run, sys.exc_info()[1])
    if refused:
        sys.exit(1)


if __name__ == "__main__":
    main()
