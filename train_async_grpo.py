"""Asynchronous GRPO for multi-turn tool use: vLLM generates while the trainer trains.

    # CPU, one process: launches its own vLLM server on the model, then trains
    python train_async_grpo.py --model models/tiny --env retool --max-steps 20
    # against servers that are already running (vllm_server.py or `make serve`)
    python train_async_grpo.py --model models/tiny --env retool --vllm-url http://127.0.0.1:8000
    # continue a run where its last checkpoint left it; curves
    python train_async_grpo.py --model models/tiny --env retool --output-dir runs/x --resume
    python scripts/plot_metrics.py runs/x/metrics.jsonl --out runs/x/plots
    # 8 GPUs: servers on GPUs 0-1 (`--vllm-gpus K`: 0..K-1), trainer rank r on GPU K + r (FSDP2)
    torchrun --nproc-per-node 6 train_async_grpo.py --model Qwen/Qwen2.5-7B-Instruct --vllm-gpus 2

The device plan is checked before anything starts and printed in one line; one GPU needs --vllm-url.
Several nodes: docs/multinode.md.

Multi-rank (WORLD_SIZE > 1): FSDP2 on each decoder layer, then the root (nccl on GPU, gloo on CPU). Rank 0
owns the servers, the rollout worker, eval, metrics and checkpoint files; each step it broadcasts the
packed sequences (or a stop message), every rank trains on micro-batches rank::world_size, and every rank
joins the gathers of the weight sync and of the checkpoints (the same files whatever the rank count).

The loop. A rollout worker (rollout.py, in a process of its own: rollout_process.py) keeps generating
scored groups of `--num-generations` completions per prompt, admitting a group only while it stays within
`--max-staleness` model versions of the trainer. Each step takes `--prompts-per-step` groups in the order
they finish, skips groups whose rewards are all equal, packs the sequences, takes `--mini-batches` AdamW
steps, and every `--sync-every` steps pushes the weights into the servers (weight_sync.py): a new version.

Choices a reader should know before the code (loss.py lists the loss's own departures; docs/design.md
has the depth):
  - Staleness is counted in model versions. A group later than `--max-staleness` is trained, IS-corrected
    (its behaviour logprobs are exact); `--drop-stale` drops it, a bias against long tool episodes.
  - One optimizer step per batch by default: π_old is the forward's own logprobs, detached, and the clip
    is inert; `--mini-batches N` makes it a live trust region for one extra no-grad forward.
  - Precision: fp32 weights and AdamW state, bf16 forward/backward on GPU (`--compute-dtype`); the sync
    casts to the servers' bf16. bf16 weights would not train: at lr 1e-6 an update is below half an ulp.
  - Logprobs are those of the distribution vLLM samples from (temperature, top-k/top-p: sampling.py); every
    request states every sampling field, a start-up probe and a per-sync check refuse a server that
    samples otherwise (docs/fidelity.md).
  - Packing: a micro-batch is one row of concatenated sequences, each attending only to itself (batches.py).
  - Resume (checkpoint.py) loses no row: the checkpoint records the rows admitted and not yet trained, and
    the resumed worker admits them first; a resume over another seed or dataset is refused, and so is a
    fresh run into another run's --output-dir.
  - Faults: a server that dies or restarts does not stop the run (`heal`); Ctrl-C and SIGTERM stop it
    between steps; it stops (with a checkpoint) only if no batch comes within --batch-timeout.
"""

import argparse
import asyncio
import functools
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Before torch loads its OpenMP runtime: on CPU the trainer shares the cores with the vLLM servers, the
# rollout process and the sandbox, and OpenMP's default of spinning at every barrier starves them and
# itself (a train step while a server generates: `python bench/bench_openmp.py`, figure 9). On GPU the
# trainer's CPU threads barely use OpenMP (not measured there).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
from tqdm import tqdm

import lora
from batches import BatchTimeout, StreamPosition, batch_sequences, collect_groups
from chat_format import ChatTemplate, ChatTemplateError
from checkpoint import (
    RESUMED_FLAGS,
    CheckpointError,
    checkpoint_to_resume,
    resume_from,
    resumed_flags,
    row_stream_identity,
    save_checkpoint,
)
from distributed import broadcast_message, place_ranks
from envs import ENVS, episode_maker, verify
from envs.confine import parse_cpus
from envs.data import load_datasets
from evaluate import evaluate
from fidelity import TOP_N, FidelityError, Prober, SyncChecks, probe_at_start
from metrics import (
    NoTracker,
    json_line,
    make_tracker,
    mark_logged,
    open_jsonl,
    perf_metrics,
    rollout_counters,
    rollout_metrics,
    write_completions,
)
from rollout import prompt_ids_with_room
from rollout_process import RolloutProcess, build_worker, split_cpus
from sampling import MIN_TEMPERATURE
from trainer import (
    NonFiniteCount,
    NonFiniteSteps,
    NonFiniteWeights,
    follow_rank0,
    load_models,
    load_tokenizer,
    make_optimizer,
    model_problem,
    sampling_of,
    start_syncer,
    sync_weights,
    train_step,
)
from vllm_server import ServerStartError, healthy, relaunch_exited, served_model_name, write_servers_file
from weight_sync import WeightSyncError

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
parser.add_argument("--vllm-url", action="append", help="running vLLM server (repeatable); none: launch ours")
parser.add_argument("--sync-host", default=None,
                    help="address of this host the servers dial to join the weight sync (default: this "
                         "host's end of the route to the first non-local server; 127.0.0.1 if all are local)")
parser.add_argument("--vllm-gpus", type=int,
                    help="GPUs 0..K-1 for launched servers (default: those the ranks leave; CPU: one)")
parser.add_argument("--vllm-tp", type=int, default=1, help="GPUs per launched server (tensor parallel)")
parser.add_argument("--server-timeout", type=float, default=600.0, help="start-up limit for launched servers")
parser.add_argument("--batch-timeout", type=float, default=600.0, help="seconds to wait for a batch")
parser.add_argument("--prompts-per-step", type=int, default=8, help="groups (prompts) per optimizer step")
parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (G)")
parser.add_argument("--max-staleness", type=int, default=1, help="versions admitted ahead (0 = sync)")
parser.add_argument("--drop-stale", action="store_true",
                    help="drop groups over --max-staleness when trained (biased against long episodes)")
parser.add_argument("--rollout-cpus",
                    help="CPUs of launched servers, the rollout process, tools, rewards ('2-7')")
parser.add_argument("--max-turns", type=int, default=4, help="assistant messages per completion")
parser.add_argument("--max-calls-per-turn", type=int, default=1, help="hermes parallel tool calls per turn")
parser.add_argument("--max-context", type=int, default=2048, help="prompt + completion tokens, hard cap")
parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (also for logprobs)")
parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (trained exactly)")
parser.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (trained exactly)")
parser.add_argument("--sandbox-workers", type=int, default=8, help="concurrent tool (sandbox) processes")
parser.add_argument("--unsafe-sandbox", action="store_true",
                    help="run tools even where the sandbox cannot confine them (README: Sandbox)")
parser.add_argument("--reward-timeout", type=float, default=verify.DEADLINE_S, help="seconds per answer")
parser.add_argument("--keep-zero-variance", action="store_true", help="train on all-equal-reward groups")
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
parser.add_argument("--compute-dtype", choices=["bf16", "fp32"],
                    help="forward/backward dtype over fp32 weights (default: bf16 on GPU, fp32 on CPU)")
parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="packed tokens per forward pass")
parser.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per batch (> 1: live clip)")
parser.add_argument("--gradient-checkpointing", choices=["auto", "on", "off"], default="auto",
                    help="recompute activations in backward; auto: on only when a micro-batch's would not "
                         "fit in free memory (trainer.choose_checkpointing; the start-up line says why)")
parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile each decoder layer and the logprob head's elementwise work "
                         "(trainer.compile_model); auto: on CUDA, off on CPU (inductor's ~20 s at start-up)")
parser.add_argument("--sync-every", type=int, default=1, help="weight sync every N steps (a model version)")
parser.add_argument("--fidelity-every", type=int, default=1,
                    help="after every N-th sync, re-score each server's probe with new weights (0: never)")
parser.add_argument("--max-nonfinite-steps", type=int, default=3,
                    help="non-finite steps in a row (that update never applied) that stop the run, exit 1")
parser.add_argument("--lora-rank", type=int, default=0,
                    help="train and sync a rank-R adapter on the frozen base (0: full fine-tuning)")
parser.add_argument("--lora-alpha", type=float, default=0.0, help="adapter scale alpha/R (0: alpha = 2R)")
parser.add_argument("--lora-targets", default=",".join(lora.DEFAULT_TARGETS), help="linear layers adapted")
# Logging and checkpoints
parser.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
parser.add_argument("--resume", nargs="?", const="latest", help="checkpoint dir; bare: --output-dir's latest")
parser.add_argument("--eval-every", type=int, default=0, help="evaluate at start, every N steps, at the end")
parser.add_argument("--eval-limit", type=int, default=64, help="held-out rows per evaluation")
parser.add_argument("--log-completions-every", type=int, default=10, help="write trajectories every N steps")
parser.add_argument("--report-to", default="none", choices=["none", "tensorboard", "wandb", "trackio"],
                    help="experiment tracker (if installed)")
# fmt: on


def given_flags(argv: list[str] | None, dests: tuple[str, ...]) -> set[str]:
    """Which of `dests` (plain stored flags) are on the command line: argparse fills a dest from its
    default only where the namespace it parses into lacks it."""
    unset = object()
    given = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests, unset)))
    return {dest for dest in dests if getattr(given, dest) is not unset}


def check_args(args: argparse.Namespace) -> None:
    """Bad arguments fail here, before any server or model is started, naming the argument."""
    positive = ["prompts_per_step", "num_generations", "max_turns", "max_calls_per_turn", "max_context",
                "max_steps", "micro_batch_tokens", "sync_every", "save_every", "vllm_tp", "sandbox_workers",
                "log_completions_every", "eval_limit", "mini_batches"]  # fmt: skip
    for name, value in vars(args).items():  # nan passes every comparison below
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    for name in ["max_staleness", "warmup_steps", "eval_every", "kl_beta", "eps_low", "eps_high",
                 "weight_decay", "lr", "top_k", "fidelity_every", "max_nonfinite_steps"]:  # fmt: skip
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 0, got {getattr(args, name)}")
    batch = args.prompts_per_step * args.num_generations
    checks = [
        (args.vllm_gpus is not None and args.vllm_gpus < 1, f"--vllm-gpus must be ≥ 1, got {args.vllm_gpus}"),
        (args.reward_timeout <= 0, f"--reward-timeout must be > 0 seconds, got {args.reward_timeout}"),
        (args.server_timeout <= 0, f"--server-timeout must be > 0 seconds, got {args.server_timeout}"),
        (args.batch_timeout <= 0, f"--batch-timeout must be > 0 seconds, got {args.batch_timeout}"),
        (args.temperature < MIN_TEMPERATURE, f"--temperature must be ≥ {MIN_TEMPERATURE} for training "
         f"(logprobs divide by it; vLLM raises a smaller one to {MIN_TEMPERATURE}), got {args.temperature}"),
        (not 0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
        (args.is_cap <= 0 or args.max_grad_norm <= 0, "--is-cap and --max-grad-norm must be > 0"),
        (args.eps_low >= 1, f"--eps-low must be < 1, got {args.eps_low}"),
        (args.num_generations < 2,
         f"--num-generations must be ≥ 2 (group advantages need a group), got {args.num_generations}"),
        (args.mini_batches > batch, f"--mini-batches {args.mini_batches} exceeds the {batch} sequences of a "
         "batch (--prompts-per-step × --num-generations)"),
        (args.sync_every > args.max_steps, f"--sync-every {args.sync_every} exceeds --max-steps "
         f"{args.max_steps}: no sync would come, and the servers would sample the initial weights all run"),
    ]  # fmt: skip
    for bad, why in checks:
        if bad:
            parser.error(why)
    if args.rollout_cpus is not None:
        try:
            cpus = parse_cpus(args.rollout_cpus)
        except ValueError:
            parser.error(f"--rollout-cpus: {args.rollout_cpus!r} is not a CPU list like '0' or '2-5,7'")
        if max(cpus) >= (os.cpu_count() or 1):
            parser.error(f"--rollout-cpus: CPU {max(cpus)} does not exist ({os.cpu_count()} CPUs)")
    for name in ["dataset", "eval_dataset"] if args.eval_every else ["dataset"]:
        path = getattr(args, name)
        if path.endswith((".jsonl", ".parquet")) and not os.path.isfile(path):
            parser.error(f"--{name.replace('_', '-')}: {path} does not exist")
        if os.path.exists(path) and not path.endswith((".jsonl", ".parquet")):
            parser.error(
                f"--{name.replace('_', '-')}: {path} is not a .jsonl or .parquet file (nor a Hugging Face "
                "dataset name)"
            )
    if args.chat_template and not os.path.isfile(args.chat_template):
        parser.error(f"--chat-template: {args.chat_template} does not exist (a jinja file)")
    if why := model_problem(args.model, args.max_context):
        parser.error(f"--model: {why}")
    if why := lora.args_problem(args):
        parser.error(why)
    if args.resume not in (None, "latest") and not os.path.isdir(args.resume):
        parser.error(f"--resume: {args.resume} is not a checkpoint directory")
    for u in args.vllm_url or []:
        if not u.startswith(("http://", "https://")):
            parser.error(f"--vllm-url must start with http:// or https://, got {u}")
        if not healthy(u.rstrip("/")):
            parser.error(
                f"--vllm-url: no vLLM server answers at {u}: start one first (`make serve`, vllm_server.py) "
                "and wait until it is up, or leave out --vllm-url to launch one"
            )
    out_dir = Path(args.output_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--output-dir: cannot create {out_dir} ({e.strerror}); choose another directory")
    if not os.access(out_dir, os.W_OK):
        parser.error(f"--output-dir: {out_dir} is not writable; choose another directory")


# THE RUN (rank 0): what the loop advances, and what a checkpoint, a heal and the shutdown need --------------
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
    position: StreamPosition  # the row stream: rows admitted and not yet trained, where admission stopped
    stop_flag: dict  # {"stop": True} once SIGINT or SIGTERM came: the loop stops between steps
    last_saved: int = 0  # step of the newest checkpoint (or of the resume)
    # An update was applied since the last sync: the model is no longer that version's weights, which a
    # server healed now would get under its tag (--sync-every N > 1: N − 1 steps a sync)
    moved_since_sync: bool = False
    groups_since_sync: int = 0  # groups trained since the last sync (admission slots of that version)
    row_stream: dict = field(default_factory=dict)  # what `position` indexes: checkpoint.row_stream_identity
    metrics_file: object = None  # metrics.jsonl, appended to
    completions_file: object = None  # completions.jsonl (the rollout viewer's rows), appended to
    tracker: object = field(default_factory=NoTracker)
    bar: object = None  # the tqdm progress bar
    servers: list = field(default_factory=list)  # launched here; none with --vllm-url
    syncer: object = None  # weight_sync.WeightSyncer, once the servers are up
    worker: object = None  # rollout_process.RolloutProcess (rank 0), given its worker once the servers are up
    checks: object = None  # fidelity.SyncChecks: the per-sync check, once the servers are up
    nonfinite: NonFiniteCount = field(default_factory=NonFiniteCount)  # steps train_step did not apply
    t_last: float = 0.0  # when the last step's metrics were taken (time.monotonic)
    request_s: float = 0.0  # the worker's request_seconds then


def save(run: Run) -> Path:
    """A checkpoint of the current step; the other ranks join the gathers of the full state."""
    if run.worker is not None:  # failed groups count as used, as in an uninterrupted run
        run.position.consume(run.worker.stats.failed_rows)
    state = {"step": run.step, "model_version": run.version, "dataset_position": run.position.frontier}
    state |= {"pending_rows": sorted(run.position.pending), "args": vars(run.args)}
    state["row_stream"] = run.row_stream
    broadcast_message({"save": state}, run.world_size)
    return save_checkpoint(run.out_dir, run.model, run.tokenizer, run.optimizer, run.scheduler, state)


def heal(run: Run, push: bool = True) -> None:
    """Bring servers back into the run (WeightSyncer owns each one's state): our own that exited or are
    stuck are relaunched; any that answers without our weights rejoins and, unless a sync to all
    follows at once (`push=False`), gets the current weights: those of the current version only, so
    once an update moved them since (--sync-every N > 1) it gets the next sync (until then its tag
    is not the version the client routes to). A failure is retried at the syncer's doubling waits
    (WeightSyncer.rejoin), named on stderr when it starts failing, not at each try."""
    relaunch_exited(run.servers, run.out_dir / "vllm-logs" / "servers.json", stuck=run.syncer.to_restart())
    stale = run.syncer.rejoin()
    if not stale:
        return
    push = push and not run.moved_since_sync
    try:
        if push:
            sync_weights(run.syncer, run.model, run.version, run.world_size, urls=stale)
    except WeightSyncError as e:
        failing = [u for u in stale if u in run.syncer.failed] or stale
        if run.syncer.newly_failing(failing):
            print(
                f"could not bring {', '.join(failing)} back yet: {e}. Tried again at doubling waits (not "
                "named again at each try)",
                file=sys.stderr,
                flush=True,
            )
        return
    what = f"model version {run.version}" if push else "the next sync"
    print(f"{', '.join(stale)}: new weight-transfer group, gets {what}", file=sys.stderr, flush=True)


def start_rollouts(
    run: Run, server_gpus: list[str], template: ChatTemplate, make_episode, rows: list[dict],
    probe_prompts: list[list[int]], eval_rows: list[dict], device, ckpt,
) -> tuple[list[str], tuple, dict[str, float]]:  # fmt: skip
    """Servers up (those of --vllm-url, or launched here on `server_gpus`), the weight-transfer group
    formed, our weights pushed, the fidelity probe (on `probe_prompts`, the first rows') passed, the
    rollout worker built, the start-up eval (--eval-every) done, the worker started. Returns (server
    URLs, evaluate's arguments, the probe's gaps)."""
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
            seed=args.seed, dtype=serving_dtype, cpus=args.rollout_cpus,  # generation side: rollout CPUs
            lora_rank=args.lora_rank, lora_slots=args.max_staleness + 2,  # the versions in flight, + 1
        )  # fmt: skip
        urls, model_name = [s.url for s in run.servers], str(args.model)
        write_servers_file(run.servers, run.out_dir / "vllm-logs" / "servers.json")
    # From here Ctrl-C is deferred in every mode (as SIGTERM is): it stops the run between steps
    # (collect_groups raises KeyboardInterrupt), never inside an optimizer step, a weight sync or a
    # checkpoint write. Before this point (server start-up) there is nothing to leave half-done.
    signal.signal(signal.SIGINT, lambda *_: run.stop_flag.update(stop=True))
    run.syncer = start_syncer(args, urls, run.model, run.out_dir, on_gpu, serving_dtype)
    # Always push ours, even onto launched servers that hold the base model: servers given by
    # --vllm-url may hold anything, a checkpoint's weights must go in, and the version tag it sets
    # is how a restarted server (tag "default", base weights) is told apart from one in step.
    sync_weights(run.syncer, run.model, run.version, run.world_size)
    bf16 = args.compute_dtype == "bf16" or serving_dtype == "bfloat16"  # either side bf16: the KL bound
    served = (lambda: lora.adapter_name(run.syncer.version)) if args.lora_rank else model_name  # LoRA: v{n}
    prober = Prober(
        served, probe_prompts, sampling_of(args), args.seed, run.model, bf16, run.world_size, device
    )
    fidelity = probe_at_start(prober, urls)
    run.checks = SyncChecks(prober, run.syncer)
    print(
        f"fidelity probe: {len(urls)} server(s) sample what the trainer scores (max |Δ logprob| "
        f"{fidelity['fidelity/max_abs_diff']:.2g}, mismatch KL {fidelity['fidelity/mismatch_kl']:.2g}, "
        f"bare request's top-{TOP_N} gap {fidelity['fidelity/bare_top_rms_diff']:.2g} nats rms)",
        flush=True,
    )
    # The worker is built in its own process (the same tokenizer, env and rows) while the start-up eval
    # runs, and admits groups from run.worker.start() on.
    build = functools.partial(
        build_worker, args, ckpt, urls, model_name, rows, run.position.frontier,
        sorted(run.position.pending), run.version, ENVS[args.env],
    )  # fmt: skip
    run.worker.build(build, lambda: run.syncer.version, run.version)
    expected_version = run.worker.client.expected_version
    eval_args = (served, template, make_episode, eval_rows, args, expected_version)  # evaluate's, less urls
    if args.eval_every and run.step == 0:  # the start, before any rollout competes for the servers
        start = {"step": 0, "model_version": run.version} | evaluate_now(run, eval_args)
        run.metrics_file.write(json_line(start))
        run.metrics_file.flush()
        run.tracker.log(start, 0)
        print(f"eval at start: {json.dumps(start)}", flush=True)
    run.worker.start()
    return urls, eval_args, fidelity


# LOOP STEPS -------------------------------------------------------------------------------------------------
NO_SYNC = {"sync/seconds": 0.0, "sync/mb": 0.0, "sync/mb_per_s": 0.0, "sync/servers_failed": 0.0}


def sync_if_due(run: Run) -> dict[str, float]:
    """Every --sync-every steps: a new model version, pushed into the servers; the worker admits by it.
    A server that fails is left out (named on stderr, counted) and brought back by `heal` once it
    answers; the run stops only if no batch comes within --batch-timeout."""
    sync = dict(NO_SYNC)
    if run.step % run.args.sync_every == 0:
        run.version += 1
        run.moved_since_sync = False  # these weights are the new version's (a server that fails: heal's)
        run.groups_since_sync = 0
        heal(run, push=False)
        try:
            sync.update(sync_weights(run.syncer, run.model, run.version, run.world_size))
        except WeightSyncError as e:
            print(f"\nstep {run.step}: {e}", file=sys.stderr, flush=True)
        sync["sync/servers_failed"] = float(len(run.syncer.failed))
        # The weights have landed: turns finishing from now on are on this version (a server the check
        # takes out stops being routed to when it is).
        run.worker.set_version(run.version)
        # The check's requests run beside the next step; it finishes before that step's update (train_on).
        # After the last step nothing more is trained: no check (a resume probes every server).
        if run.args.fidelity_every and run.version % run.args.fidelity_every == 0:
            if run.step < run.args.max_steps:
                run.checks.start(run.version, run.step)
    return sync


def train_on(run: Run, groups: list, ref_model, device) -> tuple:
    """Every rank trains its share of `groups` (train_step), less those a server found out of step
    sampled: the last sync's check finishes before the update is applied (fidelity.SyncChecks.train).
    Returns ((train/ metrics, sequences, completions logged, their π_old), or None when no group is
    left; the groups trained). Those left out free their admission slots, as a stale group does
    (collect_groups): a step that trained none would otherwise leave the next batch none to come."""

    def train(groups: list) -> tuple:
        seqs = batch_sequences(groups)
        logged, traced = mark_logged(groups, seqs, run.step, run.args.log_completions_every), {}
        broadcast_message({"batch": seqs}, run.world_size)
        step = (run.model, ref_model, run.optimizer, run.scheduler, seqs, run.args, 0, run.world_size, device)
        return train_step(*step, traced), seqs, logged, traced

    trained, kept = run.checks.train(run.optimizer, groups, train)
    if len(kept) < len(groups):
        run.worker.discard(len(groups) - len(kept))
    return trained, kept


def stop_between_steps(world_size: int) -> dict:
    """{"stop": False}, set once SIGTERM (and, under torchrun, Ctrl-C) comes: rank 0 stops between two
    steps, never inside a collective, then tells the other ranks, which ignore both signals (torchrun
    SIGKILLs them if rank 0 dies). One process defers Ctrl-C once its servers are up (start_rollouts)."""
    stop_flag = {"stop": False}
    signal.signal(signal.SIGTERM, lambda *_: stop_flag.update(stop=True))
    if world_size > 1:
        signal.signal(signal.SIGINT, lambda *_: stop_flag.update(stop=True))
    return stop_flag


def step_metrics(
    run: Run, groups, queue_counts: tuple, trained_at: int, seqs, wait_s: float, train_s: float
) -> dict[str, float]:
    """The step's position, rollout/ and perf/ keys. `queue_counts`: collect_groups' (taken, dropped,
    skipped)."""
    now, request_s = time.monotonic(), run.worker.stats.request_seconds
    step_s, request_span = now - run.t_last, request_s - run.request_s
    run.t_last, run.request_s = now, request_s
    metrics = {
        "step": run.step,
        "model_version": run.version,
        "dataset_position": run.position.frontier,
        "dataset_pending": len(run.position.pending),  # rows a resume admits first
    }
    taken, dropped, skipped = queue_counts
    metrics |= rollout_metrics(groups, dropped, skipped, taken, trained_at)
    generated = metrics["rollout/generated_tokens"]
    return metrics | perf_metrics(run.worker, request_span, step_s, wait_s, train_s, seqs, generated)


def evaluate_now(run: Run, eval_args: tuple) -> dict[str, float]:
    """The greedy held-out eval (evaluate.py) on every server that answers; its time is not a step's,
    nor are the rollout requests in flight during it (perf/requests_in_flight)."""
    t_eval, request_s = time.monotonic(), run.worker.stats.request_seconds
    heal(run)
    metrics = asyncio.run(evaluate(list(run.syncer.urls), *eval_args))  # not those taken out since
    metrics["perf/eval_s"] = time.monotonic() - t_eval
    run.t_last += metrics["perf/eval_s"]
    run.request_s += run.worker.stats.request_seconds - request_s
    return metrics


def log_step(run: Run, metrics: dict, text_fields: dict, groups, logged, traced: dict) -> None:
    """One metrics.jsonl line (with `text_fields`, which the tracker does not take), the tracker, the
    progress bar, and the rollout viewer's rows of the completions logged this step."""
    run.metrics_file.write(json_line(metrics | text_fields))
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
    after an exception mid-step) → release the other ranks and the sync group → stop the servers. (After
    a kill -9, <output_dir>/vllm-logs/servers.json names the launched servers' process groups.)"""
    if run.bar is not None:
        run.bar.close()
    if run.worker is not None:
        run.worker.stop(timeout_s=10.0)
        if run.worker.built:  # a start-up that failed before the servers were up has no counters to say
            print(rollout_counters(run.worker.stats, run.worker.client.stats), file=sys.stderr, flush=True)
    # `exc` is what ended the run (main passes it). These strike between steps, every rank waiting for
    # rank 0's next message: Ctrl-C, a batch that never came, a refusal, the non-finite limit (saved
    # already), NonFiniteWeights (raised on every rank; not saved). Anything else may strike mid-step,
    # inside a collective: nothing is saved, no message sent (torchrun ends the other ranks).
    # A checkpoint that could not be written (a full disk) strikes after the other ranks' part of it.
    between = (KeyboardInterrupt, BatchTimeout, FidelityError, NonFiniteSteps, NonFiniteWeights)
    between_steps = exc is None or isinstance(exc, (*between, WeightSyncError, CheckpointError))
    unsaved = False  # the final checkpoint could not be written: the shut-down goes on, then exit 1
    not_saved = (NonFiniteWeights, CheckpointError)  # nothing to save; a full disk, not tried again
    if run.step > run.last_saved and between_steps and not isinstance(exc, not_saved):
        try:
            print(f"saved {save(run)}", flush=True)
        except CheckpointError as e:
            unsaved = True
            print(f"stopping at step {run.step}: {e}", file=sys.stderr, flush=True)
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
    if unsaved:
        sys.exit(1)


# What ends a run with exit 1, in one line: a refusal at start-up (fidelity, the transfer groups, a server
# that would not start: with its log's tail), every server out of step after a sync, the non-finite limit
# (saved already), weights non-finite after a step (nothing synced or saved), a checkpoint that could not
# be written, no batch within --batch-timeout (then a checkpoint).
REFUSALS = {
    FidelityError: "refusing to train: {e}",
    WeightSyncError: "weight sync: {e}",
    NonFiniteSteps: "stopping at step {step}: {e}",
    NonFiniteWeights: "stopping at step {step}: {e}; nothing synced or saved",
    CheckpointError: "stopping at step {step}: {e}",
    ServerStartError: "{e}",
    BatchTimeout: "\nstopping at step {step}: {e}",  # after the progress bar's line
}


def main(argv: list[str] | None = None) -> None:
    args = parser.parse_args(argv)
    verify.DEADLINE_S = args.reward_timeout
    check_args(args)

    # SET-UP ------------------------------------------------------------------------------------------
    out_dir = Path(args.output_dir)  # made by check_args
    eval_dataset = args.eval_dataset if args.eval_every else None
    try:  # a dataset that cannot be read, has no rows or a bad row ends the run here, in one line
        rows, eval_rows = load_datasets(args.dataset, eval_dataset, args.eval_limit)
    except ValueError as e:
        sys.exit(str(e))
    row_stream = row_stream_identity(rows, args.seed, args.dataset)
    try:  # --resume: the checkpoint it names, or (no value) the latest in --output-dir, and its flags
        ckpt = checkpoint_to_resume(args.resume, out_dir, row_stream)
        taken = resumed_flags(ckpt, args, given_flags(argv, RESUMED_FLAGS)) if ckpt else []
    except ValueError as e:
        parser.error(str(e))
    if taken and int(os.environ.get("RANK", 0)) == 0:
        print(f"resuming with the checkpoint's {' '.join(taken)}", flush=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    try:  # --rollout-cpus: the rollout side there, the trainer on the rest
        split_cpus(args.rollout_cpus)
    except OSError as e:
        parser.error(f"--rollout-cpus {args.rollout_cpus}: cannot run there ({e})")
    # Rank 0's rollout process, forked now, before any thread, CUDA context, server or model of ours
    # exists; it gets its worker once the servers are up (start_rollouts).
    worker = RolloutProcess() if int(os.environ.get("RANK", 0)) == 0 else None
    args.compute_dtype = args.compute_dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    try:  # checked before anything starts: launched servers take GPUs 0..K−1, trainer rank r GPU K + r
        server_gpus, rank, world_size, device = place_ranks(
            args.vllm_gpus, args.vllm_tp, not args.vllm_url, args.compute_dtype,
            collective_timeout_s=args.server_timeout + 3 * args.batch_timeout,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    # sandbox_mode: the sandbox/ keys of the first step's metrics line
    make_episode, sandbox_mode = episode_maker(args.env, args.sandbox_workers, args.unsafe_sandbox, rank)
    try:  # a template that cannot serve the rollout: one line, before anything starts
        tokenizer, template = load_tokenizer(args, ckpt, make_episode(rows[0]))
    except ChatTemplateError as e:
        parser.error(
            f"--chat-template {args.chat_template}: {e}" if args.chat_template else f"{args.model}: {e}"
        )
    # The start-up probe samples the first rows' prompts: one that fills --max-context was refused by the
    # server (a launched one's context is --max-context) after its start-up, in words that blamed the
    # server; against a --vllm-url of a longer context the rollouts drop every such row's group (with a
    # --max-context below every prompt: each group, until --batch-timeout).
    try:
        probe_prompts = [
            prompt_ids_with_room(template, make_episode(r).messages, args.max_context) for r in rows[:4]
        ]
    except ValueError as e:
        parser.error(
            f"--max-context {args.max_context} is too small for the first rows: {e} (raise --max-context)"
        )
    model, ref_model, ckpt_checksum = load_models(args, ckpt, device, world_size)
    optimizer, scheduler = make_optimizer(model, args)
    step, version, position = resume_from(ckpt, model, optimizer, scheduler, rank, world_size, ckpt_checksum)
    if step >= args.max_steps:  # before any server starts: they would start, then nothing would train
        parser.error(
            f"--resume: {ckpt} is at step {step} of --max-steps {args.max_steps}: nothing left to train "
            "(raise --max-steps to go on)"
        )
    stop_flag = stop_between_steps(world_size)
    if rank != 0:
        follow_rank0(
            model, ref_model, optimizer, scheduler, tokenizer, args, out_dir, rank, world_size, device
        )
        dist.destroy_process_group()
        return
    run = Run(
        args, out_dir, model, tokenizer, optimizer, scheduler, world_size, step, version, position, stop_flag,
        last_saved=step, row_stream=row_stream, metrics_file=open_jsonl(out_dir / "metrics.jsonl"),
        completions_file=open_jsonl(out_dir / "completions.jsonl"), worker=worker,
    )  # fmt: skip
    refused, exc = False, None  # exc: what ended the run, for shutdown
    try:
        # START ROLLOUTS: servers, weight sync group, fidelity probe, the worker thread -------------
        run.tracker = make_tracker(args.report_to, out_dir, vars(args))  # before the start-up eval
        urls, eval_args, fidelity = start_rollouts(
            run, server_gpus, template, make_episode, rows, probe_prompts, eval_rows, device, ckpt
        )

        # TRAIN LOOP --------------------------------------------------------------------------------
        run.bar = tqdm(total=args.max_steps, initial=run.step, desc="grpo", dynamic_ncols=True)
        run.t_last, run.request_s = time.monotonic(), run.worker.stats.request_seconds
        while run.step < args.max_steps:
            groups, taken, dropped, skipped, wait_s = collect_groups(
                run.worker, args.prompts_per_step, run.version, args, urls, stop_flag,
                functools.partial(heal, run),
            )  # fmt: skip

            # Every rank gets the batch and trains on its share of it (train_on). The servers' weight tags
            # that the sync's heal reads are asked for meanwhile.
            t_train = time.monotonic()
            if (run.step + 1) % args.sync_every == 0:
                run.syncer.poll_ahead()
            trained_at = run.version  # the version the batch's lags are measured against
            trained, groups = train_on(run, groups, ref_model, device)
            run.position.consume(g.row["_index"] for g in taken)  # trained, or dropped as a whole run would
            if trained is None:  # every group sampled by a server out of step (fidelity/groups_dropped)
                continue
            train, seqs, logged, traced = trained
            run.step += 1
            train_s = time.monotonic() - t_train
            nonfinite = train.pop("nonfinite")  # named on stderr
            # Mini-batches before a non-finite one were applied: the servers must get the weights they
            # moved, or they would sample from weights the trainer no longer has.
            applied = int(train["train/optimizer_steps"])
            run.moved_since_sync |= applied > 0
            run.groups_since_sync += len(groups)
            too_many = run.nonfinite.record(nonfinite, run.step, args.max_nonfinite_steps, applied)
            if run.moved_since_sync:
                sync = sync_if_due(run)
            else:  # no update applied since the last sync (non-finite steps): nothing to sync
                sync = dict(NO_SYNC)
                if run.step % args.sync_every == 0:
                    # No new version either, and the worker admits by version: these groups give back
                    # their slots, or after 1 + --max-staleness such versions it admits none, for good.
                    run.worker.discard(run.groups_since_sync)
                    run.groups_since_sync = 0
            train["train/nonfinite_steps"] = float(run.nonfinite.total)

            # Metrics: one dict per step (fidelity: the start-up probe's on the first line, then the check
            # of the sync before the step, finished in it).
            metrics = step_metrics(run, groups, (taken, dropped, skipped), trained_at, seqs, wait_s, train_s)
            metrics |= train | sync | fidelity | run.checks.logged()
            fidelity = {}
            if args.eval_every and (run.step % args.eval_every == 0 or run.step == args.max_steps):
                metrics |= evaluate_now(run, eval_args)
            trained_rows = {"trained_rows": [g.row["_index"] for g in groups]}  # stream indices
            log_step(run, metrics, sandbox_mode | trained_rows, groups, logged, traced)  # sandbox_mode: once
            sandbox_mode = {}
            if too_many:
                run.last_saved = run.step
                raise NonFiniteSteps(
                    f"{run.nonfinite.in_row} non-finite steps in a row (--max-nonfinite-steps), last: "
                    f"{nonfinite}; checkpoint of the last finite weights: {save(run)}"
                )
            if run.step % args.save_every == 0:
                save(run)
                run.last_saved = run.step
    except KeyboardInterrupt as e:
        exc = e
        print(f"\ninterrupted at step {run.step}; saving a final checkpoint", file=sys.stderr, flush=True)
    except tuple(REFUSALS) as e:  # one line, exit 1
        exc, refused = e, True
        line = next(v for k, v in REFUSALS.items() if isinstance(e, k))
        print(line.format(e=e, step=run.step), file=sys.stderr, flush=True)
    except BaseException as e:  # a crash: shut down, then it propagates
        exc = e
        raise
    finally:
        # SHUTDOWN: stop admitting → stop the worker → release the sync group → stop the servers ----
        shutdown(run, exc)
    if refused:
        sys.exit(1)


if __name__ == "__main__":
    main()
