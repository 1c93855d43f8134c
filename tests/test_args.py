"""Bad arguments end in one line naming the problem and the way out, before any server or model starts:
exit 2 with argparse's usage for what check_args finds, exit 1 for a dataset that cannot be used. No
traceback, no hang."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import train_async_grpo as T

REPO = Path(__file__).resolve().parent.parent


def test_bad_arguments_fail_before_anything_starts(capsys, tiny_model):
    for argv, name in [
        (["--max-steps", "0"], "--max-steps"),
        (["--temperature", "0"], "--temperature"),
        (["--dataset", "nope.jsonl"], "--dataset"),
        (["--vllm-url", "localhost:8000"], "--vllm-url"),
        (["--num-generations", "1"], "--num-generations"),
        (["--mini-batches", "0"], "--mini-batches"),
        (["--mini-batches", "65"], "--mini-batches 65 exceeds the 64 sequences"),
        (["--rollout-cpus", "x"], "--rollout-cpus: 'x' is not a CPU list"),
        (["--rollout-cpus", "4096"], "--rollout-cpus: CPU 4096 does not exist"),
        (["--fidelity-every", "-1"], "--fidelity-every must be ≥ 0"),
        (["--max-nonfinite-steps", "-1"], "--max-nonfinite-steps must be ≥ 0"),
    ]:
        with pytest.raises(SystemExit):
            T.main(["--model", str(tiny_model), *argv])
        assert name in capsys.readouterr().err


def test_each_bad_argument_is_one_line_and_no_traceback(tmp_path, tiny_model):
    """The script itself, once per bad argument (all at once: each is an interpreter start-up)."""
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "garbled.jsonl").write_text('{"question": "1+1?", "answer": "2"}\nnot json\n')
    (tmp_path / "a-file").write_text("")
    offline = {"HF_HUB_OFFLINE": "1"}
    cases = [  # (extra arguments, environment, exit code, what the line must say)
        (["--model", "/nonexistent"], {}, 2, "--model: /nonexistent does not exist"),
        (["--model", "models/no-such-model"], offline, 2, "not in the Hugging Face cache"),
        (["--model", "no-such-org-x1/no-such-model-x1"], {}, 2, "not in the Hugging Face cache"),
        (["--model", str(REPO / "data")], {}, 2, "has no config.json"),
        (["--dataset", "README.md"], {}, 2, "--dataset: README.md is not a .jsonl or .parquet file"),
        (["--vllm-url", "http://127.0.0.1:9"], {}, 2, "--vllm-url: no vLLM server answers at"),
        (["--output-dir", str(tmp_path / "a-file" / "run")], {}, 2, "--output-dir: cannot create"),
        (["--chat-template", str(tmp_path / "nope.jinja")], {}, 2, "--chat-template: "),
        (["--dataset", str(tmp_path / "empty.jsonl")], {}, 1, "empty.jsonl: no rows"),
        (["--dataset", str(tmp_path / "garbled.jsonl")], {}, 1, "garbled.jsonl: line 2: not JSON"),
    ]
    procs = []
    for extra, env, _, _ in cases:
        argv = ["--model", str(tiny_model), "--output-dir", str(tmp_path / "out"), *extra]
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "train_async_grpo.py"), *argv], cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, **env),
        ))  # fmt: skip
    for (extra, _, code, says), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=300)
        lines = err.splitlines()
        assert proc.returncode == code, (extra, proc.returncode, err[-3000:])
        assert "Traceback" not in err + out, (extra, err)
        if code == 2:  # argparse: its usage lines, then the one line
            assert lines[-1].startswith("train_async_grpo.py: error: "), (extra, err)
            assert all(x.startswith(("usage:", " ")) for x in lines[:-1]), (extra, err)
        else:
            assert len(lines) == 1, (extra, err)
        assert says in lines[-1], (extra, says, lines[-1])
    assert not (tmp_path / "out" / "vllm-logs").exists()  # no server was started
