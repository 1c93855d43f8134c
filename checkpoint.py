"""The checkpoint format: <output_dir>/checkpoints/step_NNNNNN/ holds the model in save_pretrained form
(with the tokenizer) and trainer_state.pt (optimizer state keyed by parameter name, scheduler, RNG
states, step, model version, the row stream's position, the run's arguments). The same files whatever
the number of ranks. Written to a temp dir and renamed (a step saved again: the old one renamed aside first),
so a kill -9 leaves the newest step directory whole; the next save removes the temp dirs of killed saves.

Resume loses no row: rows are shuffled with the seed (a new permutation each epoch) and read as one
endless stream, and the checkpoint stores `dataset_position` (the frontier: just after the highest
stream index consumed) and `pending_rows` (the indices below it admitted but not trained when it was
written: still generating, queued, or taken by an unfinished step). The resumed worker admits those
first, then the stream from the frontier (batches.StreamPosition says what counts as consumed), so
every row is trained once: the slow, multi-turn groups in flight at a kill too. The rollout worker starts
at the resumed version. metrics.jsonl is appended to, so steps a killed run logged after its last
checkpoint appear twice; scripts/plot_metrics.py keeps the last line per step.

Those indices mean rows only of the same stream: the checkpoint also stores the stream's identity (the
seed, the row count, a digest of the rows: row_stream.json, read before anything loads), and a resume
over another seed or dataset stops with one line (`check_row_stream`) instead of silently training
other rows. So does a LoRA resume over another --model than its adapter's base (`resumed_flags`), and a
run whose --output-dir holds another run's checkpoints, without --resume or resuming another dir's
(`checkpoint_to_resume`).
"""

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from batches import StreamPosition


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk); its temp dir is removed, the older ones are whole."""


def not_written(kind: str, path: Path, e: BaseException, kept: str) -> CheckpointError:
    """The one line for a save that failed (a full disk, mostly): what, why, the space left where it
    was going, what is still whole, and the way out. The caller removes its temp dir first."""
    free_gb = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free / 2**30
    why = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return CheckpointError(
        f"could not write the {kind} {path} ({why}; {free_gb:.1f} GiB free there): {kept}; free space, "
        "then --resume"
    )


def save_checkpoint(
    out_dir: Path, model, tokenizer, optimizer, scheduler, state: dict, rank: int = 0
) -> Path:
    """Model in save_pretrained form, optimizer state keyed by parameter name (the same files for any
    number of ranks). Under FSDP every rank calls this (the full state is gathered to rank 0's CPU) and
    only rank 0 writes."""
    final = out_dir / "checkpoints" / f"step_{state['step']:06d}"
    if dist.is_initialized():
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        trained = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        weights = get_model_state_dict(model, options=trained)  # {} on ranks but 0; LoRA: the adapter
        # The gathered copies of tied weights are separate tensors, which save_pretrained (it goes by
        # storage) would write twice (Qwen2.5-1.5B: 0.9 GB more): dropped, as one process's save drops them.
        for tied in model.get_expanded_tied_weights_keys(all_submodels=True):
            weights.pop(tied, None)
        optim = get_optimizer_state_dict(model, optimizer, options=opts)
    else:
        weights, optim = None, get_optimizer_state_dict(model, optimizer)
    if rank != 0:
        return final
    # Saves killed part-way left their temp dirs, each up to a whole checkpoint: one process (rank 0 of
    # one run) writes here, so none of them is being written.
    for stale in final.parent.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    try:
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(
            {"optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rng, **state},
            tmp / "trainer_state.pt",
        )
        if "row_stream" in state:  # read by check_row_stream before the model loads
            (tmp / "row_stream.json").write_text(json.dumps(state["row_stream"]))
        if "args" in state:  # read by resumed_flags before the model loads
            (tmp / "run_args.json").write_text(json.dumps(state["args"], default=str))
    except (OSError, RuntimeError, SafetensorError) as e:
        # A full disk: torch says "unexpected pos …" (a RuntimeError), safetensors "I/O error: …", the
        # rest OSError. Anything else is a bug, and keeps its traceback.
        shutil.rmtree(tmp, ignore_errors=True)
        raise not_written("checkpoint", final, e, "older checkpoints are whole") from e
    # Re-saving a step (a run resumed from an older checkpoint): the old one is moved aside whole, then
    # removed; deleted in place, a kill would leave it half-deleted for a bare --resume to take.
    old = final.with_name(f".tmp-old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def row_stream_identity(rows: list[dict], seed: int, dataset: str) -> dict:
    """What the stream indices of a checkpoint index: the seeded permutation of these rows."""
    digest = hashlib.sha256()
    for r in rows:
        digest.update(json.dumps([r["question"], r["answer"]]).encode() + b"\n")
    return {"seed": seed, "rows": len(rows), "rows_sha256": digest.hexdigest()[:16], "dataset": dataset}


def check_row_stream(ckpt: Path, identity: dict) -> str | None:
    """None when `ckpt`'s row stream is `identity`'s (or the checkpoint predates row_stream.json); else
    the one line that says what differs and the way out."""
    path = ckpt / "row_stream.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if all(saved.get(k) == identity[k] for k in ("seed", "rows", "rows_sha256")):
        return None

    def what(s: dict) -> str:
        return f"--seed {s['seed']} over {s['dataset']} ({s['rows']} rows, digest {s['rows_sha256']})"

    return (
        f"--resume: {ckpt} was trained on {what(saved)}, this run asks for {what(identity)}: its dataset "
        f"position and pending rows would name other rows. Resume with the checkpoint's --seed and "
        f"--dataset, or start a fresh --output-dir"
    )


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = sorted((out_dir / "checkpoints").glob("step_*"))
    return ckpts[-1] if ckpts else None


def checkpoint_to_resume(resume: str | None, out_dir: Path, identity: dict) -> Path | None:
    """--resume: the checkpoint it names, or ("latest") the latest in `out_dir`; None without it.
    ValueError (one line) when there is none, or its row stream is not `identity` (check_row_stream),
    or `out_dir` holds another run's checkpoints (without --resume, or with one naming another dir's)."""
    if resume is None:
        # A fresh run there would leave that run's later checkpoints beside its own, for a bare --resume
        # to take (that run's weights and optimizer, whatever --model says), and append to its metrics.
        if (latest := latest_checkpoint(out_dir)) is not None:
            raise ValueError(
                f"--output-dir {out_dir} holds another run's checkpoints (the latest {latest.name}): give "
                "--resume to continue that run, or choose another --output-dir"
            )
        return None
    ckpt = latest_checkpoint(out_dir) if resume == "latest" else Path(resume)
    if ckpt is None:
        raise ValueError(f"--resume: no checkpoint in {out_dir / 'checkpoints'}")
    if not (ckpt / "trainer_state.pt").is_file():
        raise ValueError(
            f"--resume: {ckpt} is not a checkpoint (no trainer_state.pt): name a checkpoints/step_N "
            "directory, or give --resume alone for the latest in --output-dir"
        )
    if (why := check_row_stream(ckpt, identity)) is not None:
        raise ValueError(why)
    # Another dir's checkpoint continued here would leave this dir's beside its own, as a fresh run would
    # (above): killed before its first save, a bare --resume took this dir's latest, not the one continued.
    latest = latest_checkpoint(out_dir)
    if latest is not None and latest.resolve().parent != ckpt.resolve().parent:
        raise ValueError(
            f"--resume {ckpt}: --output-dir {out_dir} holds another run's checkpoints (the latest "
            f"{latest.name}), which a bare --resume would take: resume into another --output-dir, or give "
            "--resume alone to continue that run"
        )
    return ckpt


# What the checkpoint's adapter, optimizer and learning-rate schedule were made with: a resume under
# other values would load them into another shape (a traceback), rescale the adapter (--lora-alpha), or
# keep the checkpoint's --lr and --weight-decay while saying otherwise (the optimizer state holds them).
RESUMED_FLAGS = (
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "lr",
    "weight_decay",
    "warmup_steps",
    "lr_schedule",
)


def resumed_flags(ckpt: Path, args, given: set[str]) -> list[str]:
    """Set on `args` the checkpoint's value of each RESUMED_FLAGS flag not `given` on the command line
    (a resume continues that run: `--resume` alone is enough); returns those set, as '--flag value'.
    ValueError (one line) for a flag given with another value than the checkpoint's, or a LoRA
    checkpoint resumed over another --model than its base."""
    path = ckpt / "run_args.json"
    if not path.exists():  # a checkpoint from before run_args.json
        return []
    saved = json.loads(path.read_text())
    taken, clashes = [], []
    for dest in RESUMED_FLAGS:
        if dest not in saved or saved[dest] == getattr(args, dest):
            continue
        flag = "--" + dest.replace("_", "-")
        if dest in given:
            clashes.append(f"{flag} {saved[dest]} (this run: {getattr(args, dest)})")
        else:
            setattr(args, dest, saved[dest])
            taken.append(f"{flag} {saved[dest]}")
    if clashes:
        raise ValueError(
            f"--resume: {ckpt} was trained with {', '.join(clashes)}; a resume continues its adapter, "
            "optimizer and schedule: leave these flags out (the checkpoint's values are used) or start a "
            "fresh --output-dir"
        )
    # A LoRA checkpoint holds the adapter alone, trained on its run's --model: over another base of the
    # same shapes it would load and train on silently.
    base = saved.get("model")
    if args.lora_rank and base is not None and _other_model(base, args.model):
        raise ValueError(
            f"--resume: {ckpt} holds a LoRA adapter trained on --model {base}, this run gives --model "
            f"{args.model}: resume with --model {base}, or start a fresh --output-dir"
        )
    return taken


def _other_model(saved: str, given: str) -> bool:
    """`given` is known to be another model than `saved`: two directories that are not the same one
    (however spelled), or two hub names that differ (a hub name and a directory may be the same model)."""
    saved_dir, given_dir = os.path.isdir(saved), os.path.isdir(given)
    if saved_dir and given_dir:
        return not os.path.samefile(saved, given)
    return not saved_dir and not given_dir and saved != given


def param_checksum(named_tensors) -> float:
    """A float fingerprint of the weights (sum of |w| · (k+1) over sorted names) for resume checks."""
    total = 0.0
    for k, (_, t) in enumerate(sorted(named_tensors, key=lambda kv: kv[0])):
        total += float(t.detach().double().abs().sum()) * (k + 1)
    return total


def load_checkpoint(ckpt: Path, model, optimizer, scheduler, rank: int = 0, world_size: int = 1):
    """Restore the optimizer, scheduler and RNG states of `ckpt` (the model is loaded from it with
    from_pretrained); returns (step, model version, stream frontier, pending row indices). Under FSDP
    only rank 0 reads trainer_state.pt (memory-mapped: its pages come in as they are sent); the optimizer
    state is scattered into the shards tensor by tensor and the rest (scheduler, RNG, counters, pending
    rows: small) is broadcast, so no rank holds the whole Adam state (7B: ~61 GB) in RAM."""
    path = ckpt / "trainer_state.pt"
    if world_size > 1:
        state = torch.load(path, weights_only=False, mmap=True) if rank == 0 else {"optimizer": {}}
        rest = [{k: v for k, v in state.items() if k != "optimizer"}]
        dist.broadcast_object_list(rest, src=0)
        set_optimizer_state_dict(
            model, optimizer, state["optimizer"],
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )  # fmt: skip
        state = rest[0]
    else:
        state = torch.load(path, weights_only=False)
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if torch.cuda.is_available() and "cuda" in state["rng"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"], state["model_version"], state["dataset_position"], state.get("pending_rows", [])


def resume_from(
    ckpt: Path | None, model, optimizer, scheduler, rank: int, world_size: int, loaded_checksum: float | None
) -> tuple[int, int, StreamPosition]:
    """(step, model version, row stream position): (0, 0, the stream's start) for a fresh run, else
    `ckpt`'s (load_checkpoint), printed with the checksum of the weights loaded from it."""
    if ckpt is None:
        return 0, 0, StreamPosition()
    step, version, frontier, pending = load_checkpoint(ckpt, model, optimizer, scheduler, rank, world_size)
    print(
        f"resumed from {ckpt} at step {step}, model version {version}, dataset position {frontier} "
        f"with {len(pending)} rows admitted before it to train first "
        f"(param checksum {loaded_checksum!r})",
        flush=True,
    )
    return step, version, StreamPosition(frontier, set(pending))
