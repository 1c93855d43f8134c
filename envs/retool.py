"""ReTool-style math with a Python interpreter (`--env retool`).

The model may call `code_interpreter(code)` any number of times (the rollout worker decides the turn
budget; `is_done` never ends an episode early) and finishes with the answer in \\boxed{}. The tool's
schema reaches the model through the chat template (`tools=`), not through SYSTEM_PROMPT.

Reward: the same as `--env math` (1.0 for a matching \\boxed{} answer, else `wrong_reward`), plus an
optional tool-use term, off by default. verl's and slime's ReTool recipes add it only to wrong answers,
so it can never outweigh being right: score = min(-0.6, -1 + (num_turns - 2) / 2 * 0.1), i.e. +0.1 per
tool round, at most +0.4. We do the same relative to `wrong_reward`, counting successful calls only
(a failed call is not tool use worth encouraging): wrong -> wrong_reward + min(0.4, tool_bonus * n),
where a successful call is one the worker could run whose code then exited 0 in time (no traceback,
no nonzero exit, no timeout).
They use it because small models' tool use otherwise collapses early in RL; try `tool_bonus=0.1`.
"""

import os
import re
from dataclasses import dataclass, field

from envs.math_env import WRONG_REWARD, answer_verdict, final_answer
from envs.sandbox import Sandbox, SandboxResult, run_python

SYSTEM_PROMPT = (
    "Solve the problem. Use the code_interpreter tool for exact computation. "
    "Put the final answer in \\boxed{}."
)
TOOL_BONUS = 0.0  # per successful tool call, wrong answers only; 0.1 matches verl/slime
MAX_TOOL_BONUS = 0.4  # cap on the bonus (verl/slime: -1 + 0.4 = -0.6)
TOOL_TIMEOUT_S = 10.0

# A fence opens and closes a line of its own (so code that prints or holds "```" keeps it): three or
# more backticks, the closing run at least as long, the opening one followed by a tag or none
# (python3, ` python`, `python title="a.py"`; a tag of word characters, so the line '```"""' that ends
# a string in unfenced code opens nothing), its line ended by \n or \r\n; one left open runs to the
# end (a call cut off by the length limit). Possessive (`*+`): a line of blanks and words that is no
# opening fence is given up at once, not retried at every split of it (quadratic in the line).
_FENCE = re.compile(
    r"^[ \t]*+(`{3,}+)[ \t]*+[\w+.-]*+(?:[ \t][^`\r\n]*+)?\r?\n(?P<body>.*?)"
    r"(?:(?P<close>^[ \t]*+\1`*+[ \t]*+\r?$)|\Z)",
    re.M | re.S,
)


def _dedent(body: str) -> str:
    """`body` less the indentation all its non-blank lines share. Python code whose every line is
    indented cannot run (IndentationError), so this only changes code that would not have run; the
    indentation of blocks inside stays. Unlike textwrap.dedent, a blank line ending in \\r counts as
    blank (to textwrap it held the margin at zero)."""
    lines = body.split("\n")
    indents = [line[: len(line) - len(line.lstrip(" \t"))] for line in lines if line.strip()]
    margin = os.path.commonprefix(indents) if indents else ""
    if not margin:
        return body
    return "\n".join(line[len(margin) :] if line.startswith(margin) else line.lstrip(" \t") for line in lines)


def strip_fence(code: str) -> str:
    """The body of the first ``` fence that holds code if the model wrapped its code in one, else `code`.
    A fence with nothing in it is no wrapper: a stray closing fence after the code read as one opening
    there, and the code became the blank text after it. The body is dedented: a fence indented with its
    code (inside a list item, as models write one) kept the indentation, an IndentationError."""
    m = next((m for m in _FENCE.finditer(code) if m["body"].strip()), None)
    if m is None:
        return code
    body = m["body"]
    # Left open and ending in backticks: closed at the end of its last line (`print(x)```). Python code
    # never ends in backticks outside a string.
    if not m["close"] and (code_end := body.rstrip()).endswith("```"):
        body = code_end.rstrip("`") + "\n"
    return _dedent(body)


def format_result(r: SandboxResult, timeout_s: float) -> str:
    """What the model reads back: the output, and a precise note when the run did not end normally
    (always its last line: `ran_ok` reads it)."""
    out = r.output
    if r.timed_out:
        out += f"\n[timed out after {timeout_s:g} s; the process was killed]"
    elif r.error:
        out += f"\n[{r.error}; exit code {r.exit_code}]"
    elif r.exit_code != 0:
        out += f"\n[exit code {r.exit_code}]"
    if not out.strip():
        out = "[no output; use print() to see values]"
    return out


_FAILED_NOTE = re.compile(r"\[(?:timed out after .* s; the process was killed|.*exit code -?\d+)\]")


def ran_ok(result: str) -> bool:
    """Whether `format_result` wrote `result` for a run that ended normally: no failure note ends it.
    The record's `failed` flag only says the worker could run the call; a traceback, a nonzero exit or
    a timeout is a result the model reads. Code that prints such a note itself only forfeits its own
    bonus; a failed run cannot hide its note, which is written after all of the output."""
    return _FAILED_NOTE.fullmatch(result.rpartition("\n")[2]) is None


@dataclass
class Episode:
    messages: list[dict]  # initial chat: system + user
    answer: str  # the row's ground truth
    sandbox: Sandbox | None = None  # shared concurrency cap; None runs uncapped
    wrong_reward: float = WRONG_REWARD
    tool_bonus: float = TOOL_BONUS
    timeout_s: float = TOOL_TIMEOUT_S
    tools: list = field(default_factory=list)
    reward_timeouts: int = 0  # answers whose check overran the deadline (scored wrong); for metrics

    def __post_init__(self):
        self.tools = [self.code_interpreter]

    async def code_interpreter(self, code: str) -> str:
        """Run Python code and return everything it printed (stdout and stderr).

        Args:
            code: A complete Python program; print the values you need. numpy and sympy are available.
        """
        code = strip_fence(code)
        if self.sandbox is not None:
            r = await self.sandbox.run(code, timeout_s=self.timeout_s)
        else:
            r = await run_python(code, timeout_s=self.timeout_s)
        # The sandbox itself failed to start: raise, so the worker records a failed call.
        if r.exit_code is None:
            raise RuntimeError(r.error)
        return format_result(r, self.timeout_s)

    def reward(self, messages: list[dict], tool_calls: list) -> float:
        """1.0 for a matching final \\boxed{} answer; else wrong_reward plus the capped tool bonus."""
        verdict = answer_verdict(final_answer(messages), self.answer)
        self.reward_timeouts += verdict is None
        if verdict:
            return 1.0
        n_ok = sum(1 for c in tool_calls if not getattr(c, "failed", True) and ran_ok(str(c.result)))
        return self.wrong_reward + min(MAX_TOOL_BONUS, self.tool_bonus * n_ok)

    def is_done(self) -> bool:
        """Never ends early: the episode ends when the model answers without a tool call."""
        return False


def make_episode(
    row: dict,
    sandbox: Sandbox | None = None,
    wrong_reward: float = WRONG_REWARD,
    tool_bonus: float = TOOL_BONUS,
) -> Episode:
    """One episode for a row with `question` and `answer`. Pass one shared `Sandbox` for all episodes
    (e.g. `functools.partial(make_episode, sandbox=Sandbox(4))`) to cap concurrent interpreter runs."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": row["question"]},
    ]
    return Episode(
        messages=messages,
        answer=str(row["answer"]),
        sandbox=sandbox,
        wrong_reward=wrong_reward,
        tool_bonus=tool_bonus,
    )
