"""Bad arguments end in one line naming the problem and the way out, before any server or model starts:
exit 2 with argparse's usage for what check_args finds, exit 1 for a dataset that cannot be used. No
traceback, no hang."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import train_async_grpo as T

REPO = Path(__file__).resolve().parent.parent


def test_bad_arguments_fail_before_anything_starts(capsys, tiny_model):
    for argv, name in [
        (["--max-steps", "0"], "--max-steps"),
        (["--temperature", "0"], "--temperature"),
        (["--temperature", "0.005"], "--temperature must be ≥ 0.01"),
        (["--dataset", "nope.jsonl"], "--dataset"),
        (["--vllm-url", "localhost:8000"], "--vllm-url"),
        (["--num-generations", "1"], "--num-generations"),
        (["--mini-batches", "0"], "--mini-batches"),
        (["--mini-batches", "65"], "--mini-batches 65 exceeds the 64 sequences"),
        (["--rollout-cpus", "x"], "--rollout-cpus: 'x' is not a CPU list"),
        (["--rollout-cpus", "4096"], "--rollout-cpus: CPU 4096 does not exist"),
        (["--fidelity-every", "-1"], "--fidelity-every must be ≥ 0"),
        (["--max-nonfinite-steps", "-1"], "--max-nonfinite-steps must be ≥ 0"),
        (["--lora-rank", "600"], "--lora-rank must be in 0..512"),
        (["--lora-rank", "8", "--lora-targets", "q_proj,qproj"], "--lora-targets: qproj not linear layers"),
        (["--lora-rank", "8", "--lora-targets", "q_proj,lm_head"], "--lora-targets: lm_head is the output"),
        (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--eps-high", "inf"], "--eps-high must be a finite number, got inf"),
        (["--batch-timeout", "0"], "--batch-timeout must be > 0 seconds, got 0.0"),
        (["--server-timeout", "-5"], "--server-timeout must be > 0 seconds, got -5.0"),
    ]:
        with pytest.raises(SystemExit):
            T.main(["--model", str(tiny_model), *argv])
        assert name in capsys.readouterr().err


# Each case of the test below in a fork of one interpreter that has imported the script (as `python
# train_async_grpo.py` would: the same argv[0], uncaught exceptions printed and exit 1): an interpreter
# start-up is ~4 s of imports (torch, transformers), and ten of them were ~1 min of the suite.
FORKS = r"""
import json, os, sys, traceback
sys.argv[0] = "train_async_grpo.py"  # argparse's prog, read when the parser is built at import
sys.path.insert(0, os.getcwd())
import train_async_grpo

children = {}
for k, (argv, out, err) in enumerate(json.loads(sys.argv[1])):
    pid = os.fork()
    if pid:
        children[pid] = k
        continue
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    try:
        train_async_grpo.main(argv)
        code = 0
    except SystemExit as e:  # what the interpreter does with it
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
codes = {}
while children:
    pid, status = os.wait()
    codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[k] for k in sorted(codes)]))
"""


def test_each_bad_argument_is_one_line_and_no_traceback(tmp_path, tiny_model):
    """The script, once per bad argument: one case as `python train_async_grpo.py` itself (it needs its
    own environment), the others forked from one interpreter that imported it (FORKS)."""
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "garbled.jsonl").write_text('{"question": "1+1?", "answer": "2"}\nnot json\n')
    (tmp_path / "a-file").write_text("")
    windowed = tmp_path / "windowed"  # the tiny model's config with a 64-token sliding window
    windowed.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    config |= {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
    config.pop("layer_types", None)
    (windowed / "config.json").write_text(json.dumps(config))
    # A service that is not HTTP (an SSH banner) where a vLLM server was meant to be.
    not_http = socket.socket()
    not_http.bind(("127.0.0.1", 0))
    not_http.listen()

    def banner() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = not_http.accept()
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                conn.close()

    threading.Thread(target=banner, daemon=True).start()
    not_http_url = f"http://127.0.0.1:{not_http.getsockname()[1]}"
    no_generation_prompt = tmp_path / "no-generation-prompt.jinja"  # every prompt would end after <|im_end|>
    no_generation_prompt.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    cases = [  # (extra arguments, exit code, what the line must say)
        (["--model", str(windowed)], 2, "its attention uses a sliding window of 64 tokens (shorter than"),
        (["--model", "/nonexistent"], 2, "--model: /nonexistent does not exist"),
        (["--model", "no-such-org-x1/no-such-model-x1"], 2, "not in the Hugging Face cache"),
        (["--model", str(REPO / "data")], 2, "has no config.json"),
        (["--dataset", "README.md"], 2, "--dataset: README.md is not a .jsonl or .parquet file"),
        (["--vllm-url", "http://127.0.0.1:9"], 2, "--vllm-url: no vLLM server answers at"),
        (["--vllm-url", not_http_url], 2, "--vllm-url: no vLLM server answers at"),
        (["--vllm-url", "http://127.0.0.1:80x"], 2, "--vllm-url: no vLLM server answers at"),
        (["--output-dir", str(tmp_path / "a-file" / "run")], 2, "--output-dir: cannot create"),
        (["--chat-template", str(tmp_path / "nope.jinja")], 2, "--chat-template: "),
        (
            ["--chat-template", str(no_generation_prompt), "--env", "math"],
            2,
            "writes nothing for add_generation",
        ),
        # It ran, and the servers sampled the initial weights all run (--server-timeout 1: it launched one).
        (["--sync-every", "3", "--max-steps", "2", "--server-timeout", "1"], 2, "--sync-every 3 exceeds"),
        # It launched a server, then its start-up probe blamed the server's logprobs (HTTP 400).
        (
            ["--max-context", "32", "--env", "math"],
            2,
            "--max-context 32 is too small for the first rows: prompt of ",
        ),
        (["--dataset", str(tmp_path / "empty.jsonl")], 1, "empty.jsonl: no rows"),
        (["--dataset", str(tmp_path / "garbled.jsonl")], 1, "garbled.jsonl: line 2: not JSON"),
    ]
    common = ["--model", str(tiny_model), "--output-dir", str(tmp_path / "out")]
    # HF_HUB_OFFLINE is read when huggingface_hub is imported: this case is an interpreter of its own.
    offline = subprocess.Popen(
        [sys.executable, str(REPO / "train_async_grpo.py"), *common, "--model", "models/no-such-model"],
        cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    files = [(tmp_path / f"{k}.out", tmp_path / f"{k}.err") for k in range(len(cases))]
    plan = [([*common, *extra], str(out), str(err)) for (extra, _, _), (out, err) in zip(cases, files)]
    forks = subprocess.run(
        [sys.executable, "-c", FORKS, json.dumps(plan)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert forks.returncode == 0, forks.stderr[-3000:]
    codes = json.loads(forks.stdout.splitlines()[-1])
    out, err = offline.communicate(timeout=300)
    results = [(out, err, offline.returncode)] + [
        (o.read_text(), e.read_text(), c) for (o, e), c in zip(files, codes)
    ]
    cases = [(["--model", "models/no-such-model"], 2, "HF_HUB_OFFLINE is set: download it first")] + cases
    for (extra, code, says), (out, err, returncode) in zip(cases, results, strict=True):
        lines = err.splitlines()
        assert returncode == code, (extra, returncode, err[-3000:])
        assert "Traceback" not in err + out, (extra, err)
        if code == 2:  # argparse: its usage lines, then the one line
            assert lines[-1].startswith("train_async_grpo.py: error: "), (extra, err)
            assert all(x.startswith(("usage:", " ")) for x in lines[:-1]), (extra, err)
        else:
            assert len(lines) == 1, (extra, err)
        assert says in lines[-1], (extra, says, lines[-1])
    assert not (tmp_path / "out" / "vllm-logs").exists()  # no server was started
    not_http.close()
