"""A newcomer's first hour: scripts/demo.py and scripts/plot_metrics.py on what goes wrong first (the
demo's model not built yet, a trainer run that exits before it logs anything, a metrics path that is a
run dir or not there yet): one line naming the problem and the way out, never a traceback; and a
researcher's `make demo` leaves the committed figures in docs/ alone."""

import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent


def script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True, timeout=timeout
    )


def test_the_demo_without_its_model_says_how_to_build_it(tmp_path):
    """Before `make demo-model` the demo started a vLLM server on the missing dir and died ~25 s later
    with the server's traceback (transformers' "Repo id must be in the form ...") and then its own."""
    r = script("demo.py", "--model", "models/nope", "--runs-dir", str(tmp_path / "runs"),
               "--figures-dir", str(tmp_path / "docs"), timeout=300)  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "models/nope" in r.stderr and "make demo-model" in r.stderr
    assert not (tmp_path / "runs").exists()  # refused before any server started


@pytest.mark.slow
def test_a_run_that_logs_nothing_stops_the_demo_in_one_line(tmp_path):
    """A trainer that exits before its first eval (here refused at start-up: --max-steps 0; on a machine
    whose sandbox cannot contain, the same) left no metrics.jsonl, and the demo died with a
    FileNotFoundError traceback under the trainer's one line."""
    r = script("demo.py", "--retool-steps", "0", "--runs-dir", str(tmp_path / "runs"),
               "--figures-dir", str(tmp_path / "docs"), timeout=600)  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--max-steps" in r.stderr  # the trainer's own line says why
    assert "demo: the retool run logged no held-out eval" in r.stderr
    assert not (tmp_path / "docs" / "demo_summary.json").exists()  # no summary of a run that never ran


def test_plot_metrics_of_a_run_dir_or_a_missing_file(tmp_path):
    """view_rollouts.py takes the run dir; plot_metrics.py given the same dir died with IsADirectoryError,
    and given a metrics.jsonl not written yet with FileNotFoundError (both tracebacks)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n')
    r = script("plot_metrics.py", str(tmp_path))
    assert r.returncode == 0 and (tmp_path / "plots" / "rollout.png").is_file(), r.stderr[-2000:]
    r = script("plot_metrics.py", str(tmp_path / "nope" / "metrics.jsonl"))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().startswith(f"plot_metrics: {tmp_path / 'nope' / 'metrics.jsonl'} not found")
    assert not (tmp_path / "nope").exists()  # no empty plots/ dir left behind


@pytest.mark.slow
def test_a_killed_demo_takes_its_trainer_with_it(tmp_path):
    """`kill` (or `timeout`) of the demo while a run trains: its vLLM server goes (its watchdog), and
    the trainer, orphaned, went on retrying against the dead server until --batch-timeout (300 s)."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "scripts" / "demo.py"), "--retool-steps", "3", "--math-steps", "1",
           "--eval-limit", "4", "--runs-dir", str(runs), "--figures-dir", str(tmp_path / "docs")]  # fmt: skip
    with open(tmp_path / "out.log", "w+") as log:
        demo = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 300
        while "eval at start" not in (tmp_path / "out.log").read_text() and time.monotonic() < deadline:
            assert demo.poll() is None, (tmp_path / "out.log").read_text()[-2000:]
            time.sleep(1)
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=60)
    deadline = time.monotonic() + 30  # the trainer's own children follow it (test_faults.py)
    while trainers_of(runs) and time.monotonic() < deadline:
        time.sleep(1)
    assert trainers_of(runs) == [], (tmp_path / "out.log").read_text()[-2000:]
    assert not (tmp_path / "docs" / "demo_summary.json").exists()
    out = (tmp_path / "out.log").read_text()
    assert "demo: interrupted" in out and "Traceback" not in out, out[-2000:]


def trainers_of(runs: Path) -> list[int]:
    """Pids of the train_async_grpo.py processes writing under `runs`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or not a process
            continue
        if any(a.endswith(b"train_async_grpo.py") for a in args) and str(runs).encode() in b" ".join(args):
            pids.append(int(proc.name))
    return pids


def test_the_demo_writes_its_figures_into_its_runs_dir_and_into_docs_only_when_asked(tmp_path, monkeypatch):
    """It was: every `make demo` rewrote the committed docs/demo_retool.png, docs/demo_math.png and
    docs/demo_summary.json, leaving binary diffs in a researcher's tree. By default they go to the runs
    dir now; --update-docs (whoever refreshes the committed ones) writes docs/. The demo's own code runs
    in a repo of tmp_path's; its vLLM server and trainer runs are stand-ins that leave what a run leaves,
    a metrics.jsonl (the real ones: the slow tests above)."""
    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # its view_rollouts import
    spec.loader.exec_module(demo)
    (tmp_path / "models" / "tiny-demo").mkdir(parents=True)
    (tmp_path / "models" / "tiny-demo" / "config.json").write_text("{}")
    (tmp_path / "docs").mkdir()
    lines = [{"step": 0, "eval/accuracy": 0.0, "eval/tool_call_rate": 0.1}] + [
        {
            "step": s,
            "train/loss": 0.1,
            "perf/step_s": 1.0,
            "rollout/reward_mean": 0.2 * s,
            "rollout/staleness_mean": 0.5,
        }
        for s in (1, 2)
    ]

    def run(env: str, steps: int, out: Path, url: str, args) -> float:
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
        return 1.0

    monkeypatch.setattr(demo, "REPO", tmp_path)
    monkeypatch.setattr(
        demo, "start_vllm_server", lambda *a, **k: contextlib.nullcontext(SimpleNamespace(url=""))
    )
    monkeypatch.setattr(demo, "healthy", lambda url: True)
    monkeypatch.setattr(demo, "run", run)
    monkeypatch.setattr(demo, "write_viewer_page", lambda dirs: Path(dirs[0]) / "rollouts.html")
    monkeypatch.setattr(demo.signal, "signal", lambda *_: None)  # pytest's own SIGTERM handling stays
    figures = ["demo_math.png", "demo_retool.png", "demo_summary.json"]
    demo.main([])
    assert sorted(p.name for p in (tmp_path / "runs" / "demo").iterdir() if p.is_file()) == figures
    assert list((tmp_path / "docs").iterdir()) == []
    demo.main(["--update-docs", "--runs-dir", "runs/again"])
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == figures
    with pytest.raises(SystemExit, match="give it or --figures-dir, not both"):
        demo.main(["--update-docs", "--figures-dir", "elsewhere"])
