"""Lossless resume: the checkpoint records the rows admitted and not yet trained, the resumed run admits
them first, then the stream goes on where admission stopped. The real trainer and a real vLLM server on
the heavy-tailed workload (bench/heavy_tail_env.py): SIGKILL while slow multi-turn groups are in flight,
resume, and the rows trained over both runs are those of an uninterrupted run."""

import json
import os
import random
import resource
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import wait_for

import batches
from batches import StreamPosition, row_stream

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tiny-warm"


def test_row_stream_gives_the_pending_rows_first_then_goes_on():
    rows = [{"question": str(i)} for i in range(5)]
    full = row_stream(rows, seed=3)
    first = [next(full) for _ in range(13)]
    resumed = row_stream(rows, seed=3, start=9, pending=[1, 6, 8])
    assert [next(resumed) for _ in range(7)] == [first[i] for i in [1, 6, 8, 9, 10, 11, 12]]


def test_a_resume_shuffles_each_epoch_once_not_once_a_pending_row(monkeypatch):
    """It shuffled every row again for each pending row: over DAPO-Math-17k's 1.8M rows, ~2 s a row here,
    in the rollout worker's event loop, so a resume with 192 rows pending (--prompts-per-step 64,
    --max-staleness 2) admitted nothing for ~7 minutes of its --batch-timeout."""
    shuffled, permutation = [], batches._permutation
    monkeypatch.setattr(batches, "_permutation", lambda *a: shuffled.append(a[2]) or permutation(*a))
    rows = [{"question": str(i)} for i in range(5)]
    full = row_stream(rows, seed=3)
    first = [next(full) for _ in range(15)]
    shuffled.clear()
    resumed = row_stream(rows, seed=3, start=12, pending=[1, 3, 4, 6, 8])  # epochs 0 and 1, then 2
    assert [next(resumed) for _ in range(8)] == [first[i] for i in [1, 3, 4, 6, 8, 12, 13, 14]]
    assert shuffled == [0, 1, 2]


def test_stream_position_over_random_kills_loses_no_row_and_repeats_none():
    """A worker admitting in stream order, groups finishing in any order, some dropped (consumed), a kill
    at a random moment, a resume from the checkpoint's (frontier, pending): every row below the last
    frontier is consumed exactly once over all the runs."""
    rng = random.Random(0)
    for _ in range(200):
        position, consumed = StreamPosition(), []
        for _run in range(rng.randint(1, 4)):
            checkpoint = StreamPosition(position.frontier, set(position.pending))
            stream = row_stream([{}] * 7, 0, checkpoint.frontier, sorted(checkpoint.pending))
            in_flight, admitted = [], 0
            for _ in range(rng.randint(0, 30)):
                if rng.random() < 0.5 or not in_flight:
                    in_flight.append(next(stream)["_index"])
                    admitted += 1
                else:  # some group finishes (in any order) and a step consumes it
                    i = in_flight.pop(rng.randrange(len(in_flight)))
                    consumed.append(i)
                    position.consume([i])
            # killed: in-flight groups are lost with the process; the next run starts from `position`
        assert Counter(consumed) == Counter(set(consumed)), "a row consumed twice"
        assert set(consumed) | position.pending == set(range(position.frontier))
        assert not set(consumed) & position.pending


@pytest.mark.slow  # a warm model: `make test-fast` builds models/tiny alone
def test_a_lora_checkpoint_resumed_over_another_base_model_is_refused_in_one_line(tmp_path):
    """A LoRA checkpoint holds the adapter alone: resumed over another --model of the same shapes (tiny and
    tiny-warm) it would load and train on silently. The same base spelled another way resumes; a full
    fine-tuning checkpoint (its policy is the checkpoint's) resumes over any --model."""
    from checkpoint import RESUMED_FLAGS, resumed_flags
    from train_async_grpo import given_flags, parser

    def resume(saved: list[str], argv: list[str]) -> list[str]:
        (tmp_path / "run_args.json").write_text(json.dumps(vars(parser.parse_args(saved)), default=str))
        args = parser.parse_args(argv + ["--resume", str(tmp_path)])
        return resumed_flags(tmp_path, args, given_flags(argv, RESUMED_FLAGS))

    warm, tiny = str(REPO / "models" / "tiny-warm"), str(REPO / "models" / "tiny")
    with pytest.raises(ValueError, match=r"LoRA adapter trained on --model .*tiny-warm, this run gives"):
        resume(["--model", warm, "--lora-rank", "8"], ["--model", tiny])
    assert resume(["--model", warm, "--lora-rank", "8"], ["--model", os.path.relpath(warm)]) == [
        "--lora-rank 8"
    ]
    assert resume(["--model", warm], ["--model", tiny]) == []


IDENTITY = {"seed": 0, "rows": 4, "rows_sha256": "0" * 16, "dataset": "d.jsonl"}  # checkpoint_to_resume's


def _checkpoints(out: Path, steps: tuple[int, ...]) -> list[Path]:
    """Step dirs that checkpoint_to_resume takes for checkpoints (a trainer_state.pt, no row_stream.json)."""
    ckpts = [out / "checkpoints" / f"step_{step:06d}" for step in steps]
    for step, ckpt in zip(steps, ckpts):
        ckpt.mkdir(parents=True)
        torch.save({"step": step}, ckpt / "trainer_state.pt")
    return ckpts


def test_a_fresh_run_into_another_runs_output_dir_is_refused_in_one_line(tmp_path):
    """Started without --resume over another run's output dir, a run would leave that run's later
    checkpoints beside its own: killed at step 30, a bare --resume took the other run's step 100 (its
    weights, whatever --model said)."""
    from checkpoint import checkpoint_to_resume

    _checkpoints(tmp_path, (30, 100))
    with pytest.raises(ValueError, match=r"holds another run's checkpoints \(the latest step_000100\)"):
        checkpoint_to_resume(None, tmp_path, IDENTITY)
    assert checkpoint_to_resume(None, tmp_path / "fresh", IDENTITY) is None
    assert checkpoint_to_resume("latest", tmp_path, IDENTITY).name == "step_000100"


def test_another_dirs_checkpoint_resumed_into_an_output_dir_with_checkpoints_is_refused(tmp_path):
    """--resume naming another dir's checkpoint over an --output-dir holding checkpoints of its own went
    past the check a fresh run meets (above), to the same end: killed before its first save, a bare
    --resume took that dir's step 100 (another run's weights), not the step 30 it continued. Into a dir
    without checkpoints, or from the dir's own checkpoints however spelled, it resumes."""
    from checkpoint import checkpoint_to_resume

    _checkpoints(tmp_path / "other", (100,))
    step_10, step_30 = _checkpoints(tmp_path / "run", (10, 30))
    with pytest.raises(ValueError, match=r"holds another run's checkpoints \(the latest step_000100\)"):
        checkpoint_to_resume(str(step_30), tmp_path / "other", IDENTITY)
    assert checkpoint_to_resume(str(step_30), tmp_path / "fresh", IDENTITY) == step_30
    spelled = tmp_path / "run" / "checkpoints" / ".." / "checkpoints" / "step_000010"
    assert checkpoint_to_resume(str(spelled), tmp_path / "run", IDENTITY) == spelled


# ---------------------------------------------------------------------------------------------------
# SAVES: what a kill -9 or a full disk at any point of a save leaves for the next resume
# ---------------------------------------------------------------------------------------------------
# Saves steps 1 and 2 of a tiny model, then step 2 again (what a run resumed from an older checkpoint
# does), in a process of its own. "record": the files under the output dir at each filesystem change of
# the re-save (an audit hook: it fires before the change), one JSON line each: what a kill -9 there would
# leave. "kill": SIGKILLs itself as the re-save renames its temp dir. "fsize": the re-save under a 1 MiB
# file size limit (writes past it fail with EFBIG, as on a full disk; Python ignores SIGXFSZ).
SAVES = """
import json, os, resource, signal, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from checkpoint import save_checkpoint

model_dir, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
tokenizer = AutoTokenizer.from_pretrained(model_dir)


def save(step):
    state = {"step": step, "model_version": step, "dataset_position": 2 * step, "pending_rows": []}
    return save_checkpoint(out, model, tokenizer, optimizer, scheduler, state)


save(1), save(2)
recording = {"on": False}
CHANGES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "shutil.move", "os.truncate"}


def hook(event, args):
    writes = event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+")
    if not recording["on"] or not (event in CHANGES or writes):
        return
    if mode == "kill" and event == "os.rename":
        os.kill(os.getpid(), signal.SIGKILL)
    recording["on"] = False  # the listing's own calls are not the save's
    files = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    print(json.dumps({"at": event, "files": files}), flush=True)
    recording["on"] = True


sys.addaudithook(hook)
if mode == "fsize":
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
recording["on"] = mode != "fsize"
try:
    save(2)
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
"""


def _saves(model: Path, out: Path, mode: str) -> tuple[int, list[dict]]:
    """(exit status, the JSON lines) of SAVES in `mode`."""
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "-c", SAVES, str(model), str(out), mode], env=env, capture_output=True, text=True
    )
    assert p.returncode in (0, -signal.SIGKILL), p.stderr[-4000:]
    return p.returncode, [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]


def _visible_checkpoints(files: dict[str, int]) -> dict[str, dict[str, int]]:
    """{step dir: {file: size}} of what latest_checkpoint looks at (hidden dirs are not checkpoints)."""
    steps: dict[str, dict[str, int]] = {}
    for path, size in files.items():
        parts = Path(path).parts
        if parts[0] == "checkpoints" and not parts[1].startswith("."):
            steps.setdefault(parts[1], {})[parts[2]] = size
    return steps


def test_a_kill_anywhere_in_a_save_leaves_the_latest_checkpoint_whole(tiny_model, tmp_path):
    """At each filesystem change of a re-save, the files a kill -9 would leave: the newest visible step
    directory (what a bare --resume takes) is a whole checkpoint, never one half-deleted or half-written."""
    rc, moments = _saves(tiny_model, tmp_path, "record")
    assert rc == 0 and len(moments) > 3, moments
    whole = _visible_checkpoints(moments[-1]["files"])["step_000001"]  # steps 1 and 2: the same files
    assert {"trainer_state.pt", "model.safetensors"} <= set(whole)
    for moment in moments:
        visible = _visible_checkpoints(moment["files"])
        latest = max(visible)
        assert visible[latest] == whole, (moment["at"], latest, sorted(visible[latest]))


def test_a_save_that_fails_or_is_killed_leaves_no_temp_dir_and_a_full_disk_is_one_line(tiny_model, tmp_path):
    """A save killed part-way leaves its temp dir (up to a whole checkpoint: 7B with AdamW, ~90 GB): the
    next save removes it. One that fails on a full disk removes its own and says so in one line naming the
    checkpoint, with the one before it intact."""
    rc, _ = _saves(tiny_model, tmp_path, "kill")
    assert rc == -signal.SIGKILL
    assert [p.name for p in (tmp_path / "checkpoints").glob(".*")]  # the killed save's temp dir
    rc, lines = _saves(tiny_model, tmp_path, "fsize")
    assert rc == 0, lines
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    error = lines[-1]["error"]
    assert error.startswith("CheckpointError: could not write the checkpoint") and "\n" not in error, error
    assert "step_000002 (SafetensorError: " in error and error.endswith("free space, then --resume"), error


# ---------------------------------------------------------------------------------------------------
# THE REAL TRAINER: kill -9 with slow groups in flight, resume, compare with an uninterrupted run
# ---------------------------------------------------------------------------------------------------
P, G, STEPS, SLOW = 2, 2, 6, [0, 1, 2]  # groups per step, completions per group, steps, slow stream indices


def _dataset(path: Path) -> None:
    """16 rows of data/heavy_tail.jsonl; the rows at stream positions SLOW (seed 0) need 4 tool round
    trips, every other row 1: the slow groups are admitted first and finish last."""
    rows = [json.loads(x) for x in (REPO / "data" / "heavy_tail.jsonl").read_text().splitlines()[:16]]
    stream = row_stream([{"k": k} for k in range(len(rows))], 0)
    slow = {next(stream)["k"] for _ in range(max(SLOW) + 1)}
    for k, r in enumerate(rows):
        r["tool_turns"] = 4 if k in slow else 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _trainer(url: str, data: Path, out: Path, staleness: int, *extra: str) -> list[str]:
    # lr 0: every run samples from the same weights (each request is seeded by its row, completion and
    # turn), so a row's completions, and their lengths, are the same whichever run generates them. The
    # default 8 tool slots: the slow groups' 6 calls hold theirs through their round trips.
    return [
        sys.executable, str(REPO / "bench" / "heavy_tail_env.py"), "--model", str(MODEL),
        "--env", "heavy_tail", "--dataset", str(data), "--vllm-url", url, "--output-dir", str(out),
        "--max-steps", str(STEPS),
        "--prompts-per-step", str(P), "--num-generations", str(G), "--max-staleness", str(staleness),
        "--max-turns", "2", "--max-context", "768", "--lr", "0", "--keep-zero-variance", "--save-every", "1",
        "--log-completions-every", "1", "--batch-timeout", "300", "--seed", "0",
        *extra,
    ]  # fmt: skip


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _trained(out: Path, upto: int = STEPS, skip: tuple[int, int] = (0, 0)) -> tuple[list[int], dict]:
    """Stream indices trained by the metrics lines of steps ≤ `upto` (after the first skip[0] lines), and
    each trained row's completion lengths from completions.jsonl (after its first skip[1] lines; with
    P = G = 2 every completion is logged)."""
    steps = _lines(out / "metrics.jsonl")[skip[0] :]
    rows = [i for m in steps if m["step"] <= upto for i in m["trained_rows"]]
    lengths: dict[int, list[int]] = {}
    for x in _lines(out / "completions.jsonl")[skip[1] :]:
        if x["step"] <= upto:
            lengths.setdefault(x["row_index"], []).append(len(x["tokens"]["ids"]) + x["tokens_dropped"])
    return rows, lengths


def _run(cmd: list[str], log: Path, tool_turn_s: float) -> subprocess.Popen:
    env = dict(os.environ, BENCH_TOOL_TURN_S=str(tool_turn_s), TQDM_DISABLE="1")
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path) -> None:
    assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]


def test_kill_with_slow_groups_in_flight_then_resume_trains_every_row_once(trainer_server, tmp_path):
    data = tmp_path / "heavy.jsonl"
    _dataset(data)
    server = trainer_server  # every run pushes its own weights (lr 0: the model's) in at start-up
    # 1. --max-staleness 2: six groups admitted, the three slow ones (4 tool round trips of 60 s here:
    #    they cannot finish) stay in flight while the fast ones are trained. Killed after step 2.
    killed = tmp_path / "killed"
    proc = _run(_trainer(server.url, data, killed, 2), tmp_path / "killed.log", tool_turn_s=60)
    ckpt = killed / "checkpoints" / "step_000002"
    wait_for(ckpt.exists, proc, tmp_path / "killed.log", 600, "step-2 checkpoint")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for later in (killed / "checkpoints").glob("step_*"):
        if later != ckpt:
            subprocess.run(["rm", "-rf", str(later)], check=True)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    before, before_len = _trained(killed, upto=2)
    in_flight = set(range(state["dataset_position"])) - set(before)
    assert set(SLOW) <= in_flight, (in_flight, before)  # the slow groups were in flight at the checkpoint

    # 2. --resume with --max-staleness 0, the tool round trips at 0.5 s: the pending rows come first, then
    #    the stream from the frontier, P rows per step in order, so the run ends at a known row.
    skip = (len(_lines(killed / "metrics.jsonl")), len(_lines(killed / "completions.jsonl")))
    proc = _run(_trainer(server.url, data, killed, 0, "--resume"), tmp_path / "resumed.log", tool_turn_s=0.5)
    _finish(proc, tmp_path / "resumed.log")
    after, after_len = _trained(killed, skip=skip)

    # 3. Uninterrupted (--max-staleness 0, which trains the stream's first STEPS · P rows in order).
    whole = tmp_path / "whole"
    proc = _run(_trainer(server.url, data, whole, 0), tmp_path / "whole.log", tool_turn_s=0.5)
    _finish(proc, tmp_path / "whole.log")
    reference, reference_len = _trained(whole)

    assert sorted(reference) == list(range(STEPS * P))
    lost = set(reference) - set(before) - set(after)
    # The length bias a lossy resume brings back: the slow rows are the long ones.
    trained_len = [n for i in before + after for n in (before_len | after_len)[i]]
    admitted_len = [n for i in reference for n in reference_len[i]]
    ratio = (sum(trained_len) / len(trained_len)) / (sum(admitted_len) / len(admitted_len))
    print(
        f"trained before the kill {sorted(before)}, after the resume {after}; in flight at the checkpoint "
        f"{sorted(in_flight)}; rows lost {sorted(lost)}; trained/admitted completion length {ratio:.3f}"
    )
    assert Counter(before + after) == Counter(reference), f"rows lost: {sorted(lost)}"
    assert ratio >= 0.95
    assert state["pending_rows"] == sorted(in_flight)  # what the checkpoint records: exactly those


@pytest.mark.parametrize("save_every, step", [(1, 1), (100, STEPS)], ids=["in-the-loop", "final"])
def test_a_full_disk_at_a_save_stops_the_run_in_one_line(trainer_server, tmp_path, save_every, step):
    """The trainer under a 1 MiB file size limit (writes past it fail with EFBIG, as on a full disk): its
    first checkpoint (step 1's, or the final one at the end) cannot be written. The run stops there with
    one line naming the checkpoint and the way out, exit 1, no traceback, no temp dir left."""

    def limit_file_size() -> None:
        # The soft limit alone: the sandbox raises it to its own for the tool runs. Python ignores SIGXFSZ.
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    data, out, log = tmp_path / "heavy.jsonl", tmp_path / "out", tmp_path / "full.log"
    _dataset(data)
    env = dict(os.environ, BENCH_TOOL_TURN_S="0.1", TQDM_DISABLE="1")
    with open(log, "w") as f:
        cmd = _trainer(trainer_server.url, data, out, 0, "--save-every", str(save_every))
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                              preexec_fn=limit_file_size, timeout=600)  # fmt: skip
    text = log.read_text()
    assert proc.returncode == 1 and "Traceback" not in text, text[-4000:]
    ckpt = out / "checkpoints" / f"step_{step:06d}"
    line = f"stopping at step {step}: could not write the checkpoint {ckpt} ("
    stops = [x for x in text.splitlines() if x.startswith(line)]
    assert len(stops) == 1 and stops[0].endswith("free space, then --resume"), text[-4000:]
    assert list((out / "checkpoints").iterdir()) == []
