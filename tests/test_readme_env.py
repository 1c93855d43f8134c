"""README's "Your own environment" example, verbatim: its `python` block is saved as a module, registered
in ENVS as README says (here at run time, in the trainer's process: the checkout's envs/ stays as it is)
and trained for 2 real steps by the real trainer on the session's vLLM server (models/tiny-warm)."""

import asyncio
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from rollout import run_tool

REPO = Path(__file__).resolve().parent.parent

# What README's "Register it" line does to envs/__init__.py, done in the trainer's process instead.
LAUNCH = """
import sys
from envs import ENVS
ENVS["units"] = "units"  # before the trainer builds its --env choices
import train_async_grpo
train_async_grpo.main(sys.argv[1:])
"""


def readme_example() -> str:
    section = (REPO / "README.md").read_text().split("\n## Your own environment\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "README's 'Your own environment' should hold exactly one python block"
    return blocks[0]


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme-env")
    (d / "units.py").write_text(readme_example())
    return d


@pytest.fixture
def units(env_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(env_dir))
    sys.modules.pop("units", None)
    return importlib.import_module("units")


def test_the_readme_env_keeps_the_episode_contract(units):
    rows = units.make_rows(50)
    assert all(set(r) >= {"question", "answer"} for r in rows) and len({r["question"] for r in rows}) > 40
    ep = units.make_episode({"question": "How many m are 3.5 km?", "answer": "3500"})
    assert [m["role"] for m in ep.messages] == ["system", "user"] and "3.5 km" in ep.messages[1]["content"]
    schema = get_json_schema(ep.tools[0])  # what the chat template shows the model
    assert schema["function"]["name"] == "convert"
    assert set(schema["function"]["parameters"]["required"]) == {"value", "from_unit", "to_unit"}
    # The tool as the rollout runs it, from the model's JSON arguments.
    tools = {t.__name__: t for t in ep.tools}
    ok = asyncio.run(run_tool(tools, "convert", {"value": 3.5, "from_unit": "km", "to_unit": "m"}, None))
    assert (ok.result, ok.failed) == ("3500", False)
    bad = asyncio.run(run_tool(tools, "convert", {"value": 1, "from_unit": "au", "to_unit": "m"}, None))
    assert "unknown unit" in bad.result
    say = lambda text: ep.messages + [{"role": "assistant", "content": text}]  # noqa: E731
    assert ep.reward(say("So \\boxed{3500}."), [ok]) == 1.0
    assert ep.reward(say("\\boxed{35}"), [ok]) == 0.0 and ep.reward(say("no answer"), []) == 0.0
    # Written out whole: "5e+08" (`:g`, 211 of 1,100 rows, rounded to 6 digits) scored "500000000" wrong.
    assert not [r["answer"] for r in units.make_rows(1100) if "e" in r["answer"]]
    big = units.make_episode({"question": "mm in 500 km?", "answer": units.convert(500, "km", "mm")})
    assert big.reward(say("\\boxed{500000000}"), []) == 1.0
    row = rows[0]  # the dataset's answers are the tool's own, and score 1
    assert units.make_episode(row).reward(say(f"\\boxed{{{row['answer']}}}"), []) == 1.0


@pytest.mark.timeout(600)
def test_the_readme_env_trains_two_real_steps(env_dir, trainer_server, served_model, tmp_path):
    sys.path.insert(0, str(env_dir))
    try:
        units = importlib.import_module("units")
    finally:
        sys.path.remove(str(env_dir))
    data = tmp_path / "units_train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in units.make_rows(40)))
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-c", LAUNCH, "--model", str(served_model), "--env", "units", "--dataset", str(data),
        "--vllm-url", trainer_server.url, "--output-dir", str(out), "--max-steps", "2",
        "--prompts-per-step", "2", "--num-generations", "4", "--max-context", "512", "--max-turns", "2",
        "--keep-zero-variance", "--log-completions-every", "1", "--save-every", "1000",
        "--batch-timeout", "300",
    ]  # fmt: skip
    # The env is imported by its module path (ENVS["units"] = "units"): it is found on PYTHONPATH.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(env_dir), str(REPO)]))
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2], metrics
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt_messages"][0]["content"] == units.SYSTEM_PROMPT for r in rows)
    questions = {q["question"] for q in units.make_rows(40)}
    assert all(r["question"] in questions for r in rows)
    # The env's tools are the ones offered: a call the rollout could parse is to convert, or is told that
    # convert is what there is (the tiny model learnt code_interpreter; its calls here are often garbled).
    calls = [c for r in rows for c in r["tool_calls"] if c["name"]]
    assert all(c["name"] == "convert" or "available: convert" in c["result"] for c in calls), calls
