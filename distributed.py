"""The FSDP rank protocol: where each rank and each launched server runs, torchrun → FSDP2, and the few
collectives the trainer needs (rank 0 broadcasts each message, every rank trains on its share of the
micro-batches, per-rank sums and maxima are reduced). One process (WORLD_SIZE 1) skips every collective.
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def gather_traced(traced: dict[int, list[float]], world_size: int) -> dict[int, list[float]]:
    """Each rank knows the traced sequences of its own micro-batches only: gather them on rank 0 (a few
    sequences, on the steps that log completions)."""
    if world_size == 1:
        return traced
    parts = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(traced, parts, dst=0)
    return {k: v for part in parts or [] for k, v in part.items()}


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


# The other ranks wait for rank 0's next message on a gloo group of their own whose timeout never
# strikes: rank 0 alone bounds its lone stretches (server start-up, a batch wait, a re-join, an
# evaluation: each under its own flag), which add up to more than any fixed collective timeout; a rank 0
# that dies closes its connections, which frees the waiting ranks at once. The default group (FSDP's
# collectives, which every rank enters together) keeps `timeout_s`.
MESSAGE_WAIT = datetime.timedelta(days=365)
_message_group = None


def init_distributed(first_gpu: int, timeout_s: float) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Under torchrun (WORLD_SIZE > 1) joins the default group: nccl on GPU,
    gloo on CPU, and the message group (`broadcast_message`). Rank r trains on GPU first_gpu + r
    (launched servers take GPUs 0..first_gpu−1). `timeout_s` bounds the collectives every rank enters
    together (training, the gathers of a weight sync or a checkpoint), so it must cover what rank 0 does
    alone inside them: a weight sync's HTTP calls and sends (each bounded by its own timeout)."""
    global _message_group
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{first_gpu + local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
        _message_group = dist.new_group(backend="gloo", timeout=MESSAGE_WAIT)
    return rank, world_size, device


def place_ranks(
    vllm_gpus: int | None, vllm_tp: int, launch_servers: bool, compute_dtype: str, collective_timeout_s: float
) -> tuple[list[str], int, int, torch.device]:
    """(CUDA_VISIBLE_DEVICES of each server to launch, rank, world_size, device): plan_devices for this
    box, then init_distributed; rank 0 prints the plan in one line. A plan that does not fit raises
    ValueError (plan_devices) before anything starts."""
    on_gpu = torch.cuda.is_available()
    num_gpus = torch.cuda.device_count() if on_gpu else 0
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    server_gpus, rank_devices = plan_devices(
        num_gpus, ranks, vllm_gpus, vllm_tp, launch_servers,
        node_rank=int(os.environ.get("GROUP_RANK", 0)),  # torchrun's node rank
    )  # fmt: skip
    first_gpu = int(rank_devices[0].removeprefix("cuda:")) if on_gpu else 0
    rank, world_size, device = init_distributed(first_gpu, collective_timeout_s)
    if rank == 0:
        print(describe_plan(num_gpus, server_gpus, rank_devices) + f"; compute {compute_dtype}", flush=True)
    return server_gpus, rank, world_size, device


def shard_model(model, compute_dtype: str = "fp32") -> None:
    """FSDP2: each decoder layer is a unit (its weights gathered for its forward, freed after), the
    root holds the rest (embeddings, final norm, lm_head). Parameter names are unchanged, and each
    parameter becomes a DTensor sharded on dim 0 over the ranks. With bf16 compute the shards stay in
    their dtype (fp32 masters), the gathered weights are bf16 and gradients are reduced in fp32."""
    policy = MixedPrecisionPolicy()
    if compute_dtype == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.get_decoder().layers:  # a PeftModel's too (LoRA: base and adapter together)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def load_sharded(model, full, device: torch.device, compute_dtype: str):
    """Shard `model`, a skeleton on the meta device (no storage), and fill its shards from `full`, the
    same model with its weights on rank 0's CPU (None on the other ranks): no rank but 0 ever holds the
    whole model, and rank 0 holds it in host memory only. Every rank shards the skeleton (shard_model),
    gives its shards storage on `device` (to_empty) and receives them one tensor at a time
    (set_model_state_dict with broadcast_from_rank0: each rank keeps its rows of each tensor), so its
    peak is its shard plus the largest tensor in flight. The buffers no state dict holds (rotary
    inv_freq, computed at init: a skeleton has no values) are sent from `full` too, so every rank
    computes with what from_pretrained gives. Tied weights stay one parameter, sent once."""
    rank = dist.get_rank()
    shard_model(model, compute_dtype)
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.state_dict() if rank == 0 else {}, options=options)
    sent = dict(full.named_buffers()) if rank == 0 else {}
    for name, buf in model.named_buffers():  # a few small tensors
        if rank == 0:
            buf.copy_(sent[name])
        dist.broadcast(buf, src=0)
    return model


def broadcast_message(message, world_size: int):
    """Rank 0's `message` (plain Python: lists, dicts, numbers) on every rank, pickled, over the message
    group: the other ranks wait for it as long as rank 0 works (see MESSAGE_WAIT)."""
    if world_size == 1:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0, group=_message_group)
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


def reduce_over_ranks(sums: torch.Tensor | None, maxima: torch.Tensor | None, world_size: int) -> None:
    """Sums and maxima of per-rank metrics, in place on the device (no host read: the caller reads them
    once, when it needs them)."""
    if world_size == 1:
        return
    for t, op in ((sums, dist.ReduceOp.SUM), (maxima, dist.ReduceOp.MAX)):
        if t is not None:
            dist.all_reduce(t, op=op)
