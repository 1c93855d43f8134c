"""The trainer's model, on every rank: loading it (fp32 masters, a frozen reference for --kl-beta,
FSDP2 over ranks) and its tokenizer; `train_step` (one update over this rank's packed micro-batches,
then clipped AdamW); and the messages rank 0 sends the others (`follow_rank0`): train on a batch, join
the gathers of a weight sync, a re-score or a checkpoint. train_async_grpo.py decides when each happens.
"""

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import lora
from batches import collate, pack, packed_attention, unapplied_attention
from chat_format import ChatTemplate
from checkpoint import param_checksum, save_checkpoint
from distributed import broadcast_message, gather_traced, load_sharded, rank_micro_batches, reduce_over_ranks
from loss import grpo_loss
from metrics import keep_traced
from sampling import Sampling, compile_head, rescore, token_logprobs
from weight_sync import WeightSyncer


# ---------------------------------------------------------------------------------------------------
# LOADING: the model to train (fp32 masters), the frozen reference, the tokenizer and its chat template
# ---------------------------------------------------------------------------------------------------
def sampling_of(args: argparse.Namespace) -> Sampling:
    return Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)


def load_models(args: argparse.Namespace, ckpt: Path | None, device: torch.device, world_size: int):
    """(model, frozen reference model or None, param checksum of the loaded checkpoint or None).
    fp32 weights and optimizer state whatever the compute dtype (see train_step); FSDP2 over ranks,
    each rank materialising only its shard (distributed.load_sharded). Both models attend within each
    sequence of a packed row (batches.packed_attention, named here)."""
    attn = packed_attention(device, args.compute_dtype)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"trainer attention: {attn} (each packed sequence attends only to itself)", flush=True)
    lora_rank, sharded = getattr(args, "lora_rank", 0), world_size > 1
    rank0 = not sharded or torch.distributed.get_rank() == 0

    def build(path, dtype: torch.dtype, meta: bool = False) -> torch.nn.Module:
        """The model at `path` with its weights on the CPU, or (meta) its skeleton without storage."""
        if not meta:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path), dtype=dtype, attn_implementation=attn
            )

    def policy(meta: bool = False) -> torch.nn.Module:
        # LoRA: the base is always --model (a checkpoint holds the adapter alone), frozen in the compute
        # dtype; rank 0's copy reads the checkpoint's adapter, the skeleton gets it from there
        m = build(args.model if lora_rank else (ckpt or args.model), torch.float32, meta)
        return lora.attach_for_training(m, args, None if meta else ckpt) if lora_rank else m

    # Under FSDP only rank 0 reads the weights (on the CPU); every rank builds a skeleton without storage
    # and receives its shard of rank 0's copy (distributed.load_sharded, after checkpointing and compile
    # are set on the skeleton below): no rank holds the whole model on its device.
    full = policy() if rank0 else None  # first: LoRA's initial adapter takes one process's RNG draws
    model = policy(meta=True) if sharded else full.to(device)
    model.train()
    loaded_checksum = None
    if ckpt is not None:
        checksum = param_checksum(full.named_parameters()) if rank0 else None
        loaded_checksum = broadcast_message(checksum, world_size)
    ref_model, ref_dtype = None, torch.bfloat16 if args.compute_dtype == "bf16" else torch.float32
    if args.kl_beta > 0 and not lora_rank:  # LoRA: the reference is the model with its adapter disabled
        ref_model = build(args.model, ref_dtype, meta=sharded)  # frozen: no fp32 masters
        ref_model = (ref_model if sharded else ref_model.to(device)).eval().requires_grad_(False)
    # Gradients and AdamW state exist for the trained parameters alone: with LoRA the adapter, not the
    # frozen base (7B with a rank-16 adapter: 0.5 GiB, not 86 GiB).
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Under FSDP the shards are not on the device yet: each takes its dtype's bytes (a LoRA base and the
    # --kl-beta reference are in the compute dtype, not fp32).
    unloaded = [m for m in (model, ref_model) if m is not None] if sharded else []
    shard_bytes = sum(p.numel() * p.element_size() for m in unloaded for p in m.parameters()) / world_size
    # The largest forward: pack puts a sequence longer than --micro-batch-tokens alone in its micro-batch,
    # so up to --max-context tokens (--micro-batch-tokens 1 is an unpacked run).
    longest_forward = max(args.micro_batch_tokens, args.max_context)
    on, why = choose_checkpointing(
        args.gradient_checkpointing, model.config, trainable, longest_forward, world_size,
        args.compute_dtype == "bf16", free_memory(device, shard_bytes),
    )  # fmt: skip
    if on:
        model.gradient_checkpointing_enable()
        if lora_rank:  # the frozen embeddings' output must carry a gradient into the checkpointed layers
            model.enable_input_require_grads()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"gradient checkpointing: {'on' if on else 'off'} ({why})", flush=True)
    compile_model(getattr(args, "compile", "auto"), device, model, ref_model)  # before FSDP shards them
    if sharded:  # one whole model at a time on rank 0's host: the policy's, then the reference's
        model, full = load_sharded(model, full, device, args.compute_dtype), None
        if ref_model is not None:
            ref_full = build(args.model, ref_dtype) if rank0 else None
            ref_model = load_sharded(ref_model, ref_full, device, args.compute_dtype)
    return model, ref_model, loaded_checksum


# Activation bytes a decoder layer keeps per token for its backward, in 16-bit compute (twice in fp32):
# Korthikanti et al. 2022's 34·hidden for a layer whose attention keeps no T × T scores (per-sequence
# sdpa, flash), plus 10 bytes per unit of a SwiGLU MLP's intermediate width (gate, up, their product,
# the activation, the fp32 upcasts around the norms). At Qwen2.5-1.5B's shape this is 142 KB per token
# per layer, 30 GiB at 8,192 tokens; issue 38's H100 run peaked at 57 GiB without checkpointing, of
# which ~24 GiB weights, gradients and AdamW state: ~33 GiB for the rest (the formula leaves ~10 % to
# CHECKPOINT_HEADROOM).
def activation_bytes(config, tokens: int, bf16: bool) -> int:
    per_layer = 34 * config.hidden_size + 10 * config.intermediate_size
    return tokens * config.num_hidden_layers * per_layer * (1 if bf16 else 2)


CHECKPOINT_HEADROOM = 0.85  # of the free memory: the allocator's fragmentation, the head's chunks, NCCL


def choose_checkpointing(
    setting: str, config, trainable_params: int, micro_batch_tokens: int, world_size: int, bf16: bool,
    free_bytes: int | None,
) -> tuple[bool, str]:  # fmt: skip
    """(on, why) for --gradient-checkpointing: "on" / "off" as given; "auto" turns it on only when the
    activations of a `micro_batch_tokens`-token forward (the largest one) without it, plus the gradients
    and AdamW state still to come (12 bytes per trainable parameter: the fp32 gradient and AdamW's two
    moments, sharded over ranks; a frozen LoRA base has none), would not fit in CHECKPOINT_HEADROOM of
    the free memory (`free_bytes`, measured with the weights loaded; None: unknown, so off)."""
    if setting != "auto":
        return setting == "on", f"--gradient-checkpointing {setting}"
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    acts = activation_bytes(config, micro_batch_tokens, bf16)
    state = 12 * trainable_params // world_size
    count = f"{trainable_params / 1e9:.2f}B" if trainable_params >= 1e9 else f"{trainable_params / 1e6:.1f}M"
    need = (
        f"{gib(acts)} of activations at {micro_batch_tokens}-token micro-batches + {gib(state)} of "
        f"gradients and AdamW state for {count} trainable parameters"
    )
    if free_bytes is None:
        return False, f"auto: free memory unknown; {need}"
    on = acts + state > CHECKPOINT_HEADROOM * free_bytes
    fit = "exceed" if on else "fit in"
    return on, f"auto: {need} {fit} {CHECKPOINT_HEADROOM:.0%} of the {gib(free_bytes)} free"


def free_memory(device: torch.device, taken_later: float = 0.0) -> int | None:
    """Bytes free for training on `device` (CUDA: the driver's count; CPU: MemAvailable), less
    `taken_later` (under FSDP: the rank's shard of the weights, not on the device yet)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] - taken_later)
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    kib = [int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    return int(kib[0] * 1024 - taken_later) if kib else None


def compile_model(setting: str, device: torch.device, *models) -> str:
    """--compile: each decoder layer's forward, in every model given (None: skipped), and the streamed
    head's elementwise work (sampling.compile_head) through torch.compile (inductor); returns the
    start-up line, printed on rank 0. "auto": on for CUDA (figure 10 on an H200, 1.5B shape, 8k-token
    micro-batches: 1.21x the step with the layers alone compiled), off on CPU: figure 10's CPU step at
    the real vocabulary is 1.5x faster compiled (the head's fusion), but the first step waits ~20 s
    for inductor, more than a short CPU run (the tests, the demo's 564-token vocabulary) gets back
    (docs/trainer.md). Per layer, not the whole model: all layers share one set of graphs, and what sits
    between them (checkpointing's recompute, FSDP2's gathers, transformers' output hooks) stays eager:
    only `forward` is compiled, so hooks, parameter names and checkpoints are unchanged, and FSDP2 shards
    the layers afterwards (torchtitan's order). The packed attention is left out of the graph
    (torch.compiler.disable; per_sequence_sdpa loops over the row's sequences, varlen is one kernel
    already), and its host-side kwargs go around the graph (_around_the_graph). What is compiled is the
    norms, projections, rotary, SwiGLU and residuals, with dynamic=True: one graph for every micro-batch
    (tests/test_trainer_perf.py counts the compiles, and compares the step with eager's); in the head,
    each chunk's upcast, temperature, truncation mask, log-normalizer, entropy and kept bits, and each
    vocabulary slice's softmax gradient: a pass or two over the chunk's logits instead of ~20."""
    on = setting == "on" or (setting == "auto" and device.type == "cuda")
    if setting != "auto":
        why = f"--compile {setting}"
    elif on:
        why = "auto: on CUDA, 1.21x the step in make bench-gpu; --compile off to skip inductor's ~20 s"
    else:
        why = f"auto: off on {device.type}, where inductor's ~20 s at start-up outweighs a short run's gain"
    if on:
        for model in (m for m in models if m is not None):
            name = model.config._attn_implementation
            if not hasattr(ALL_ATTENTION_FUNCTIONS[name], "outside_the_graph"):
                AttentionInterface.register(name, _outside_the_graph(ALL_ATTENTION_FUNCTIONS[name]))
            for layer in model.modules():
                if isinstance(layer, GradientCheckpointingLayer):  # transformers' decoder layers
                    layer.forward = _around_the_graph(torch.compile(layer.forward, dynamic=True))
    compile_head(on)
    line = f"compiled decoder layers and logprob head: {'on' if on else 'off'} ({why})"
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)
    return line


# batches.attention_kwargs' host-side values (the row's sequence lengths, the longest): a compiled
# layer given them would guard on them, recompiling for every new number of sequences in a row (a list's
# length is part of its guard). They go around the graph, straight to the attention.
HOST_ATTENTION_KWARGS = ("seq_lengths", "max_length_q", "max_length_k")
_set_aside: dict = {}  # the running layer's (the trainer runs one forward at a time, in one thread)


def _around_the_graph(compiled):
    """A decoder layer's forward: HOST_ATTENTION_KWARGS set aside, eagerly, the rest to `compiled`.
    Gradient checkpointing's recompute calls this again with the same kwargs."""

    def forward(*args, **kwargs):
        _set_aside.update({k: kwargs.pop(k) for k in HOST_ATTENTION_KWARGS if k in kwargs})
        try:
            return compiled(*args, **kwargs)
        finally:
            _set_aside.clear()

    return forward


def _outside_the_graph(attention):
    """The packed attention, run eagerly from inside a compiled layer, with the kwargs set aside."""

    @torch.compiler.disable
    def packed(*args, **kwargs):
        return attention(*args, **{**kwargs, **_set_aside})

    packed.outside_the_graph = True
    return packed


def model_problem(model: str, max_context: int) -> str | None:
    """None when `model` is a directory holding a model, or a hub name that is in the local cache or, with
    a network, on the hub (from_pretrained would download it), whose attention the packed attention
    applies (batches.unapplied_attention) up to `max_context` tokens; else the one line that says what is
    wrong (--model's, before anything starts: not a traceback from deep inside transformers)."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            return f"{model} has no config.json (a directory written by save_pretrained)"
        return _attention_problem(model, max_context)
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except HFValidationError:
        return f"{model} does not exist (a model directory, or a hub name like Qwen/Qwen3-0.6B)"
    if isinstance(cached, str):
        return _attention_problem(os.path.dirname(cached), max_context)
    where = f"no directory {model}, and it is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        return f"{where}; HF_HUB_OFFLINE is set: download it first (`hf download {model}`)"
    try:
        HfApi().model_info(model, timeout=10)
    except RepositoryNotFoundError:
        return f"{where} nor on the hub (private? `hf auth login` first)"
    except Exception as e:  # no network: the client's own error type varies with the transport
        return f"{where}, and the hub cannot be reached ({e}): download it where there is a network"
    return None


def _attention_problem(model_dir: str, max_context: int) -> str | None:
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, OSError, KeyError) as e:  # a config.json transformers cannot read
        return f"{model_dir}/config.json does not load ({e})"
    return unapplied_attention(config, max_context)


def lr_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    """The learning-rate factor at `step`: linear warm-up, then constant or cosine to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def make_optimizer(model, args: argparse.Namespace) -> tuple[torch.optim.Optimizer, object]:
    """AdamW over the (fp32) trainable parameters (LoRA: the adapter's alone) and its --lr-schedule after
    --warmup-steps."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, args.warmup_steps, args.max_steps, args.lr_schedule)
    )
    return optimizer, scheduler


def load_tokenizer(args: argparse.Namespace, ckpt: Path | None, episode) -> tuple[object, ChatTemplate]:
    """(tokenizer, chat template): the checkpoint's or the model's tokenizer, --chat-template if given,
    and the tools of `episode` (an env's tools are the same for every row)."""
    tokenizer = AutoTokenizer.from_pretrained(ckpt or args.model)
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    return tokenizer, ChatTemplate(tokenizer, tools=getattr(episode, "tools", None))


# ---------------------------------------------------------------------------------------------------
# TRAIN STEP: every rank holds the whole batch and trains on its share of the micro-batches
# ---------------------------------------------------------------------------------------------------
def train_step(
    model, ref_model, optimizer, scheduler, seqs, args, rank, world_size, device, traced: dict | None = None
) -> dict:
    """Forward/backward over this rank's packed micro-batches, then a clipped AdamW step: once per
    mini-batch (--mini-batches N splits the batch's sequences into N, or into one per sequence when the
    batch has fewer; N = 1 is one step on the whole batch). The loss denominators count the whole
    mini-batch (all its micro-batches, all ranks); FSDP averages gradients over ranks, so each rank's
    loss is scaled by world_size and the update is the one-process update. π_old: with N = 1 the
    forward's own logprobs, detached (the ratio is 1 and the clip inert); with N > 1 one no-grad pass
    before the first step, so later mini-batches are clipped against the policy that existed before the
    update. The scheduler steps once per call.
    Returns the train/ metrics of the whole batch (fractions over all its tokens; loss and grad norm
    the mean over the mini-batches that ran). A non-finite mini-batch is not applied and ends the step;
    the ones before it were applied (train/optimizer_steps counts them): the weights moved, so the caller
    syncs them as after any step. Checking every mini-batch before applying the first is not possible:
    each one's gradient is taken on the weights the ones before it updated.
    Sequences carrying a "trace" key (the completions logged this step) get their π_old (detached) in
    `traced` on rank 0, keyed by it."""
    # bf16 compute over fp32 weights: autocast runs the matmuls in bf16, the gradients land on the fp32
    # parameters, AdamW updates fp32 (a 1e-6 step is far below half a bf16 ulp: bf16 weights would not
    # move). Under FSDP2 the MixedPrecisionPolicy (shard_model) casts the gathered weights as well.
    bf16, sampling = args.compute_dtype == "bf16", sampling_of(args)
    # The fidelity check can drop groups after the batch was sized (fidelity.SyncChecks.train), leaving
    # fewer sequences than --mini-batches: one mini-batch per sequence then, never an empty one.
    n_mini = min(getattr(args, "mini_batches", 1), len(seqs))
    minis = [seqs[j * len(seqs) // n_mini : (j + 1) * len(seqs) // n_mini] for j in range(n_mini)]
    mini_bins = [pack(mini, args.micro_batch_tokens) for mini in minis]
    old: list[list[torch.Tensor | None]] = [[None] * -(-len(b) // world_size) for b in mini_bins]
    if n_mini > 1:
        with torch.no_grad():
            for j, (mini, bins) in enumerate(zip(minis, mini_bins)):
                for i, mb_seqs in enumerate(rank_micro_batches(mini, bins, rank, world_size)):
                    old[j][i], _ = score(model, collate(mb_seqs, device), sampling, bf16)
    sums: dict[str, float] = {}
    ratio_max, grad_norms, lr, nonfinite = 0.0, [], scheduler.get_last_lr()[0], ""
    to_trace = []  # (micro-batch sequences, their π_old on the device): read after the step
    for mini, bins, mini_old in zip(minis, mini_bins, old):
        total_tokens = float(sum(sum(s["mask"]) for s in mini))
        num_sequences = float(sum(1 for s in mini if sum(s["mask"]) > 0))
        # NO HOST SYNC UNTIL THE READ BELOW: the metrics add up on the device, the host queues work
        mini_sums = torch.zeros(len(SUMMED), dtype=torch.float64, device=device)
        mini_max = torch.zeros(1, dtype=torch.float64, device=device)
        optimizer.zero_grad(set_to_none=True)
        for mb_seqs, mb_old in zip(rank_micro_batches(mini, bins, rank, world_size), mini_old):
            mb = collate(mb_seqs, device)
            logprobs, entropy = score(model, mb, sampling, bf16, with_entropy=True)
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref, _ = score(ref_model, mb, sampling, bf16)
            elif args.kl_beta > 0:  # LoRA: the frozen base is the reference (load_models loaded no other)
                with torch.no_grad(), lora.reference(model):
                    ref, _ = score(model, mb, sampling, bf16)
            loss, m = grpo_loss(
                logprobs, logprobs.detach() if mb_old is None else mb_old, mb["behaviour"], mb["advantages"],
                mb["loss_mask"], mb["seq_index"], eps_low=args.eps_low, eps_high=args.eps_high,
                is_cap=args.is_cap, loss_norm=args.loss_norm, total_tokens=max(total_tokens, 1.0),
                num_sequences=max(num_sequences, 1.0), ref_logprobs=ref, kl_beta=args.kl_beta,
                entropy=entropy,
            )  # fmt: skip
            (loss * world_size).backward()
            if any("trace" in s for s in mb_seqs):
                to_trace.append((mb_seqs, (logprobs if mb_old is None else mb_old).detach()))
            m["loss"] = loss.detach()
            zero = loss.new_zeros(())
            mini_sums += torch.stack([m.get(k, zero) for k in SUMMED]).double()
            mini_max = torch.maximum(mini_max, m["is_ratio_max"].double())
        reduce_over_ranks(mini_sums, mini_max, world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        # THE ONE READ of this optimizer step: every metric, the loss and the gradient norm together
        *summed, mb_max, norm = torch.cat([mini_sums, mini_max, grad_norm.double()[None]]).tolist()
        for k, v in zip(SUMMED, summed):
            sums[k] = sums.get(k, 0.0) + v
        ratio_max, grad_norms = max(ratio_max, mb_max), grad_norms + [norm]
        # The guard, before the step: the loss is reduced over ranks and the norm is the whole model's,
        # so every rank takes the same decision without a collective of its own.
        nonfinite = nonfinite_before_step(summed[0], norm, model)
        if nonfinite:
            if n_mini > 1:
                nonfinite = f"mini-batch {len(grad_norms)}/{n_mini}: {nonfinite}"
            optimizer.zero_grad(set_to_none=True)  # AdamW's state never sees them
            break
        optimizer.step()
        check_weights_finite(model, lr, world_size, device)
    scheduler.step()
    traced_here: dict[int, list[float]] = {}
    for mb_seqs, lp in to_trace:
        keep_traced(traced_here, mb_seqs, lp)
    if any("trace" in s for s in seqs):
        gathered = gather_traced(traced_here, world_size)
        if traced is not None:
            traced.update(gathered)
    ntok = max(sums.get("tokens", 0.0), 1.0)
    ran = len(grad_norms)  # mini-batches forwarded: a non-finite one ends the step (not applied)
    applied = ran - bool(nonfinite)  # the first `applied` mini-batches: the weights moved by them
    return {
        "train/loss": sums["loss"] / ran,
        "train/clip_low_frac": sums["clip_low"] / ntok,
        "train/clip_high_frac": sums["clip_high"] / ntok,
        "train/is_ratio_mean": sums["is_ratio"] / ntok,
        "train/is_ratio_max": ratio_max,
        "train/is_capped_frac": sums["is_capped"] / ntok,
        "train/mismatch_kl": sums["mismatch_kl"] / ntok,
        "train/entropy": sums["entropy"] / ntok,
        "train/kl_ref": sums["kl_ref"] / ntok,
        "train/grad_norm": sum(grad_norms) / len(grad_norms),
        "train/lr": lr,
        "train/loss_tokens": sums["tokens"],
        "train/micro_batches": float(sum(len(b) for b in mini_bins)),
        "train/optimizer_steps": float(applied),
        "nonfinite": nonfinite,  # "" or what was non-finite: the loop pops it (train/nonfinite_steps)
    }


# grpo_loss's summed metrics (and the loss), in the order of the step's one device tensor of sums
SUMMED = ("loss", "tokens", "clip_low", "clip_high", "is_ratio", "is_capped", "mismatch_kl", "entropy",
          "kl_ref")  # fmt: skip


def score(model, mb: dict, sampling: Sampling, bf16: bool, with_entropy: bool = False):
    """token_logprobs of a collated micro-batch at the positions the step needs (collate's)."""
    return token_logprobs(
        model, mb["input_ids"], mb["position_ids"], sampling, with_entropy, bf16,
        positions=mb["positions"], attention=mb["attention"],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# THE GUARD: a non-finite loss or gradient is never applied; weights are checked after every step
# ---------------------------------------------------------------------------------------------------
class NonFiniteWeights(RuntimeError):
    """Weights non-finite after an AdamW step: raised on every rank (the check is reduced over them)."""


class NonFiniteSteps(RuntimeError):
    """--max-nonfinite-steps non-finite steps in a row: the run stops (exit 1) with a checkpoint."""


@dataclass
class NonFiniteCount:
    """The steps train_step did not apply in full (a non-finite loss or gradient in one of its
    mini-batches): all of them (train/nonfinite_steps), and the run of them that ends at the latest step.
    A step whose earlier mini-batches were applied counts too: the run is producing non-finite updates."""

    total: int = 0
    in_row: int = 0

    def record(self, what: str, step: int, limit: int, applied: int = 0) -> bool:
        """After every step, with its train_step "nonfinite" ("" when the step was applied) and
        train/optimizer_steps (`applied`: the mini-batches before the non-finite one, which moved the
        weights, so the loop syncs them as any step's): counts it and names it on stderr, saying what was
        applied and synced. True when it makes `limit` in a row (--max-nonfinite-steps; 0: the first)."""
        if not what:
            self.in_row = 0
            return False
        self.total, self.in_row = self.total + 1, self.in_row + 1
        done = "update not applied, nothing synced"
        if applied:
            done = (
                f"mini-batch{'es 1-' if applied > 1 else ' '}{applied} applied and synced as any step's, "
                "the rest not"
            )
        print(
            f"\nstep {step}: non-finite {what}; {done} ({self.in_row} in a row, the run stops at {limit})",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        return self.in_row >= limit


def _finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor, on the tensor's device (no host sync per parameter); FSDP: this rank's shard."""
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).isfinite().all()


def nonfinite_before_step(loss: float, grad_norm: float, model) -> str:
    """Empty when the loss and the gradient norm are finite, else what was not and where (the first
    parameter with a non-finite gradient on this rank: looked for only when the norm is not finite)."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return ""
    what = [f"loss {loss}"] if not math.isfinite(loss) else []
    if not math.isfinite(grad_norm):
        grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        where = next((n for n, g in grads if not _finite(g)), "a parameter sharded to another rank")
        what.append(f"grad norm {grad_norm} (first at {where})")
    return ", ".join(what)


def check_weights_finite(model, lr: float, world_size: int, device) -> None:
    """Raises NonFiniteWeights naming the first non-finite parameter. With the gradients checked before
    the step (finite, clipped) and the AdamW state finite, an element moves by at most a few lr, so
    this fires only when the step itself overflows fp32 (an lr near 1e38). The weights are not restored
    (that would take a copy of the model and its AdamW state every step): the run stops at once, syncs
    and saves nothing, and its newest checkpoint holds the last finite weights."""
    params = list(model.named_parameters())
    nonfinite = (~torch.stack([_finite(p) for _, p in params]).all()).double()[None]  # (1,)
    reduce_over_ranks(None, nonfinite, world_size)
    if nonfinite.item():  # the step's second and last host read
        where = next((n for n, p in params if not _finite(p)), "another rank's shard")
        raise NonFiniteWeights(f"{where} is non-finite after the AdamW step (lr {lr:g})")


# ---------------------------------------------------------------------------------------------------
# RANKS: rank 0 runs the loop and sends each step's work as a message; the others follow it
# ---------------------------------------------------------------------------------------------------
def start_syncer(args, urls: list[str], model, out_dir: Path, on_gpu: bool, serving_dtype: str):
    """The run's syncer, joined with every server: a WeightSyncer (the fp32 masters cast to the servers'
    dtype as they are sent: half the bytes on GPU), or with --lora-rank a lora.AdapterSyncer, whose
    start-up check refuses a server that cannot load the trainer's adapter (one line, exit 2)."""
    if not args.lora_rank:
        syncer = WeightSyncer(
            urls, backend="nccl" if on_gpu else "gloo", send_dtype=getattr(torch, serving_dtype),
            master_address=args.sync_host, startup_timeout_s=args.server_timeout,
        )  # fmt: skip
        syncer.init()
        return syncer
    syncer = lora.AdapterSyncer(  # adapter dirs go --batch-timeout + 60 s after their unload (docs/lora.md)
        urls, model, out_dir / "adapters", args.lora_rank, request_timeout_s=args.batch_timeout
    )
    try:
        syncer.init()
    except lora.LoRAServerError as e:
        print(e, file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return syncer


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
    syncer = WeightSyncer([], backend="nccl" if device.type == "cuda" else "gloo", rank=rank)  # gathers only
    while True:
        message = broadcast_message(None, world_size)
        if "batch" in message:
            try:
                train_step(
                    model, ref_model, optimizer, scheduler, message["batch"], args, rank, world_size, device
                )
            except NonFiniteWeights:  # every rank raised it; rank 0 says so and sends stop
                pass
        elif "sync" in message and args.lora_rank:
            lora.whole_adapter(model)  # the adapter's gathers; rank 0 writes it (AdapterSyncer.sync)
        elif "sync" in message:
            sync_weights(syncer, model, message["sync"])
        elif "rescore" in message:
            rescore(model, message["rescore"], device, args.compute_dtype == "bf16")
        elif "save" in message:
            save_checkpoint(out_dir, model, tokenizer, optimizer, scheduler, message["save"], rank)
        else:  # {"stop": True}
            return
