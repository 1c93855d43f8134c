"""train_async_grpo.py run as a researcher runs it, on the session's vLLM server (--vllm-url): how a run
that cannot go on ends. Each case is a real fault, no mock: a task no completion solves (every group's
rewards equal), a NaN in the --kl-beta reference model on disk (test_guard.py's). Its `heal` alone,
against test_weight_sync.py's fake servers (real HTTP): what a long outage prints."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_guard import _nan_model, _resume_point
from test_weight_sync import _synced_pair_with_one_restarted, syncer_clock_ahead
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoint import save_checkpoint
from train_async_grpo import heal, parser
from trainer import make_optimizer

REPO = Path(__file__).resolve().parent.parent


def _cmd(model: Path, url: str, out: Path, *extra: str) -> list[str]:
    # --env math: no tools, so no sandbox process; two short completions per group.
    return [
        sys.executable, str(REPO / "train_async_grpo.py"), "--model", str(model), "--env", "math",
        "--vllm-url", url, "--output-dir", str(out), "--prompts-per-step", "1", "--num-generations", "2",
        "--max-context", "512", "--max-turns", "1", "--save-every", "1000", *extra,
    ]  # fmt: skip


@pytest.mark.timeout(600)
def test_a_batch_timeout_ends_the_run_in_one_line(served_model, trainer_server, tmp_path):
    """No answer is right, every group's rewards are equal and skipped: no batch within --batch-timeout.
    The run stops in one line saying why, exit 1. (It printed the line, then a traceback of the
    BatchTimeout repeating it.)"""
    rows = tmp_path / "unsolvable.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{k} + 1?", "answer": "no-such-answer"}) + "\n"
                            for k in range(50)))  # fmt: skip
    cmd = _cmd(
        served_model, trainer_server.url, tmp_path / "run", "--dataset", str(rows), "--batch-timeout", "10"
    )
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    stops = [x for x in p.stderr.splitlines() if x.startswith("stopping at step 0: no batch after")]
    assert len(stops) == 1 and "all rewards equal in" in stops[0], p.stderr[-3000:]


@pytest.mark.timeout(600)
def test_steps_not_applied_free_their_admission_slots(served_model, trainer_server, tmp_path):
    """--max-staleness 0: the worker admits one version's groups ahead. A non-finite step is not applied
    nor synced, so the version stays; its groups must free their slots as a dropped group's do, or the
    next step waits for groups never admitted. (It did: the run ended in a BatchTimeout at step 2 instead
    of the --max-nonfinite-steps stop; at the default --max-staleness 1, two non-finite steps anywhere in a
    run, in a row or not, stalled it for good.)"""
    nan_model = _nan_model(served_model, tmp_path / "nan-model")
    ckpt = _resume_point(served_model, tmp_path / "seed-run")
    out = tmp_path / "run"
    cmd = _cmd(nan_model, trainer_server.url, out, "--resume", str(ckpt), "--kl-beta", "0.1",
               "--max-steps", "5", "--max-nonfinite-steps", "2", "--max-staleness", "0",
               "--keep-zero-variance", "--batch-timeout", "120")  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert p.returncode == 1, p.stderr[-3000:]
    stops = [
        x for x in p.stderr.splitlines() if x.startswith("stopping at step 2: 2 non-finite steps in a row")
    ]
    assert len(stops) == 1, p.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["train/nonfinite_steps"] for x in lines] == [1.0, 2.0]
    assert all(x["model_version"] == 0 and x["sync/mb"] == 0.0 for x in lines)


def test_a_resume_with_no_step_left_is_refused_before_any_server_starts(tiny_model, tmp_path):
    """--resume of a run that reached --max-steps (the command that ran it, again): nothing to train. It
    launched the servers, probed them, built the worker and ended with exit 0 having trained nothing
    (minutes on GPU); now one line says so and how to go on. (--server-timeout 1: a server started
    anyway ends the run otherwise.)"""
    args = parser.parse_args(["--model", str(tiny_model)])
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    optimizer, scheduler = make_optimizer(model, args)
    state = {"step": 5, "model_version": 5, "dataset_position": 40, "args": vars(args)}
    ckpt = save_checkpoint(
        tmp_path / "run", model, AutoTokenizer.from_pretrained(tiny_model), optimizer, scheduler, state
    )
    cmd = [
        sys.executable, str(REPO / "train_async_grpo.py"), "--model", str(tiny_model), "--output-dir",
        str(tmp_path / "run"), "--resume", "--max-steps", "5", "--server-timeout", "1",
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.splitlines()[-1].endswith(
        f"error: --resume: {ckpt} is at step 5 of --max-steps 5: nothing left to train (raise --max-steps "
        "to go on)"
    ), p.stderr[-3000:]
    assert not (tmp_path / "run" / "vllm-logs").exists()  # no server was started


def test_a_restarted_server_whose_weights_keep_failing_is_named_once(tmp_path, capsys, monkeypatch):
    """A restarted server that joins but fails every push of the weights (its /update_weights answers
    500: a model it cannot load them into) is tried again at the syncer's doubling waits, but heal said
    "could not bring … back yet" at each try, for as long as the outage lasted. Now once, when it starts
    failing; once a push lands, heal names it back. The syncer's clock runs 2 s a heal here."""
    servers, syncer, _, _, run = _synced_pair_with_one_restarted(tmp_path, moved_since_sync=False)
    servers[1].fail = ("/update_weights",)
    skew = syncer_clock_ahead(monkeypatch)
    while skew[0] < 400:  # heal called again and again, as in an outage
        heal(run)
        skew[0] += 2
    # the sync before its restart, then tries at 0, 10, 30, 70, 150, 270 and 390 s
    assert servers[1].calls.count("/update_weights") == 8
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"could not bring {servers[1].url} back yet"), err
    servers[1].fail = ()  # fixed: its next try gets the current weights
    while servers[1].version != "1":
        assert skew[0] < 600
        heal(run)
        skew[0] += 2
    assert f"{servers[1].url}: new weight-transfer group, gets model version 1" in capsys.readouterr().err
    assert syncer.retry == {} and syncer.join_failing == set() and syncer.failed == {}
