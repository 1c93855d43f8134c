"""A heavy-tailed variant of the retool environment for bench_async.py: each row of
data/heavy_tail.jsonl says how many tool round trips it needs (`tool_turns`, 1 to 4, most rows 1).

The tiny benchmark models always make exactly one tool call, so a row's k round trips are carried by
that call: the real sandbox run, then k − 1 further round trips of `BENCH_TOOL_TURN_S` seconds each
(default 3.0, a slow remote interpreter) whose outputs are appended to the tool response. A k-turn
row's episode is therefore both slower and longer (its tool-response tokens grow with k), as a
multi-turn tool episode is: the correlation that makes dropping late groups a length bias.

Not an `envs/` environment: bench_async.py runs the trainer through `python bench/heavy_tail_env.py
<trainer args>`, which registers it as `--env heavy_tail` and calls train_async_grpo.main.
"""

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from envs import ENVS, retool  # noqa: E402

SYSTEM_PROMPT = retool.SYSTEM_PROMPT


@dataclass
class Episode(retool.Episode):
    tool_turns: int = 1  # the row's tool round trips

    def __post_init__(self):
        self.tools = [self.code_interpreter]

    async def code_interpreter(self, code: str) -> str:
        """Run Python code and return everything it printed (stdout and stderr).

        Args:
            code: A complete Python program; print the values you need. numpy and sympy are available.
        """
        out = await super().code_interpreter(code)
        turn_s = float(os.environ.get("BENCH_TOOL_TURN_S", "3.0"))
        for k in range(2, self.tool_turns + 1):
            await asyncio.sleep(turn_s)
            out += f"\ncheck {k} of {self.tool_turns}: {out.splitlines()[0] if out else ''}"
        return out


def make_episode(row: dict, sandbox=None) -> Episode:
    base = retool.make_episode(row, sandbox=sandbox)
    return Episode(
        messages=base.messages, answer=base.answer, sandbox=sandbox, tool_turns=int(row.get("tool_turns", 1))
    )


if __name__ == "__main__":
    ENVS["heavy_tail"] = "bench.heavy_tail_env"  # before the trainer builds its --env choices
    import train_async_grpo

    train_async_grpo.main(sys.argv[1:])
