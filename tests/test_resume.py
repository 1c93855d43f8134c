"""Lossless resume: the checkpoint records the rows admitted and not yet trained, the resumed run admits
them first, then the stream goes on where admission stopped. The real trainer and a real vLLM server on
the heavy-tailed workload (bench/heavy_tail_env.py): SIGKILL while slow multi-turn groups are in flight,
resume, and the rows trained over both runs are those of an uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from conftest import wait_for

from batches import StreamPosition, row_stream

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tiny-warm"


def test_row_stream_gives_the_pending_rows_first_then_goes_on():
    rows = [{"question": str(i)} for i in range(5)]
    full = row_stream(rows, seed=3)
    first = [next(full) for _ in range(13)]
    resumed = row_stream(rows, seed=3, start=9, pending=[1, 6, 8])
    assert [next(resumed) for _ in range(7)] == [first[i] for i in [1, 6, 8, 9, 10, 11, 12]]


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
