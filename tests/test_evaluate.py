"""The held-out eval (evaluate.py) on the real tool loop and client, with the real tiny model's tokenizer
(models/tiny: what `make test-fast` builds)."""

import asyncio
import math
import socket
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from chat_format import ChatTemplate
from envs.math_env import make_episode
from evaluate import evaluate

REPO = Path(__file__).resolve().parent.parent


def test_rows_that_fail_are_named_on_stderr_and_keep_every_key(capsys):
    """Every row fails (no server listens at the URL): eval/accuracy NaN and eval/failed 2, and a line
    lacking two of the eval/ keys, were all the run said of it (here the client logs the server's removal;
    a reward or an episode that raises, or an HTTP 4xx, logged nothing at all)."""
    with socket.socket() as s:  # a port nothing listens on: connection refused, from the real client
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    template = ChatTemplate(AutoTokenizer.from_pretrained(REPO / "models" / "tiny"))
    rows = [{"question": "1 + 1?", "answer": "2"}, {"question": "2 + 2?", "answer": "4"}]
    args = SimpleNamespace(
        batch_timeout=5, max_turns=1, max_calls_per_turn=1, max_context=256, sandbox_workers=1
    )
    metrics = asyncio.run(evaluate([url], "m", template, make_episode, rows, args, None))
    assert set(metrics) == {"eval/accuracy", "eval/tool_call_rate", "eval/tool_calls_per_completion",
                            "eval/failed", "eval/reward_timeouts"}  # fmt: skip
    assert metrics["eval/failed"] == 2.0 and math.isnan(metrics["eval/accuracy"])
    err = capsys.readouterr().err
    assert "eval: 2 of 2 rows failed, the first: NoResponse: " in err and url in err, err
