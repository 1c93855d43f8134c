"""The held-out eval (evaluate.py) on the real tool loop and client, with the real tiny model's tokenizer
(models/tiny: what `make test-fast` builds)."""

import asyncio
import math
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from chat_format import ChatTemplate
from envs.math_env import make_episode
from evaluate import evaluate
from tests.test_rollout import FakeVLLM

REPO = Path(__file__).resolve().parent.parent
ARGS = SimpleNamespace(batch_timeout=5, max_turns=1, max_calls_per_turn=1, max_context=256, sandbox_workers=1)


def tiny_template() -> ChatTemplate:
    return ChatTemplate(AutoTokenizer.from_pretrained(REPO / "models" / "tiny"))


def test_rows_that_fail_are_named_on_stderr_and_keep_every_key(capsys):
    """Every row fails (no server listens at the URL): eval/accuracy NaN and eval/failed 2, and a line
    lacking two of the eval/ keys, were all the run said of it (here the client logs the server's removal;
    a reward or an episode that raises, or an HTTP 4xx, logged nothing at all)."""
    with socket.socket() as s:  # a port nothing listens on: connection refused, from the real client
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    rows = [{"question": "1 + 1?", "answer": "2"}, {"question": "2 + 2?", "answer": "4"}]
    metrics = asyncio.run(evaluate([url], "m", tiny_template(), make_episode, rows, ARGS, None))
    assert set(metrics) == {"eval/accuracy", "eval/tool_call_rate", "eval/tool_calls_per_completion",
                            "eval/failed", "eval/reward_timeouts"}  # fmt: skip
    assert metrics["eval/failed"] == 2.0 and math.isnan(metrics["eval/accuracy"])
    err = capsys.readouterr().err
    assert "eval: 2 of 2 rows failed, the first: NoResponse: " in err and url in err, err


def test_a_reward_that_calls_exit_fails_its_row_not_the_run(capsys):
    """A reward that gives up with sys.exit() (a verifier): asyncio let the SystemExit out of the eval's
    event loop and the trainer ended with it, where the same reward in training fails only its group
    (rollout.score). Now the row is counted in eval/failed and named, and the other rows are scored."""

    def episode(row):
        ep = make_episode(row)
        if row["question"] == "exit":
            ep.reward = lambda messages, tool_calls: sys.exit("verifier gave up")
        return ep

    async def run() -> dict[str, float]:
        fake = FakeVLLM(["ok"])  # every completion ends at once, with no answer: reward 0
        await fake.start()
        try:
            rows = [{"question": "exit", "answer": "2"}, {"question": "2 + 2?", "answer": "4"}]
            return await evaluate([fake.url], "m", tiny_template(), episode, rows, ARGS, None)
        finally:
            await fake.stop()

    metrics = asyncio.run(run())
    assert metrics["eval/failed"] == 1.0 and metrics["eval/accuracy"] == 0.0
    err = capsys.readouterr().err
    assert (
        "eval: 1 of 2 rows failed, the first: RuntimeError: reward raised SystemExit: verifier gave up" in err
    )


def test_a_prompt_that_fills_the_context_is_a_failed_row_not_a_wrong_answer(capsys):
    """A held-out prompt of --max-context tokens or more: the rollout ended before any request and the
    reward scored the empty answer, so the row counted as wrong in eval/accuracy and nothing said why,
    where training drops such a row as a failed group. Now it is counted in eval/failed and named."""

    async def run() -> dict[str, float]:
        fake = FakeVLLM(["ok"])
        await fake.start()
        try:
            rows = [{"question": "1 + 1? " * 200, "answer": "2"}, {"question": "2 + 2?", "answer": "4"}]
            return await evaluate([fake.url], "m", tiny_template(), make_episode, rows, ARGS, None)
        finally:
            await fake.stop()

    metrics = asyncio.run(run())
    assert metrics["eval/failed"] == 1.0 and metrics["eval/accuracy"] == 0.0
    assert "the first: ValueError: prompt of " in capsys.readouterr().err
