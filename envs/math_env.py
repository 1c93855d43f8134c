"""Tool-free math: the question, one answer in \\boxed{}, reward 1 if it matches (`--env math`).

Same data and reward as `envs/retool.py` without the interpreter, so "with tool" vs "without tool"
(ReTool's central comparison) is one flag apart. The reward helpers here are shared with retool.
"""

from dataclasses import dataclass, field
from typing import Any

from envs import verify

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
WRONG_REWARD = 0.0  # reward for a wrong or missing answer; -1.0 is the DAPO/verl/slime convention
MAX_ANSWER_CHARS = 1000  # math-verify parses with sympy, which can hang on huge inputs; longer is wrong


def last_boxed(text: Any) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, with nested braces; None if absent
    or unbalanced."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def answer_verdict(predicted: str | None, answer: str) -> bool | None:
    """math-verify equivalence (fractions, LaTeX, 1/2 vs 0.5); False on anything it cannot parse,
    None when checking overran `envs.verify.DEADLINE_S` (score it wrong, count it)."""
    if predicted is None or len(predicted) > MAX_ANSWER_CHARS:
        return False
    if predicted.strip() == answer.strip():
        return True  # fast path, and robust when math-verify cannot parse both sides
    return verify.check(answer, predicted)


def answers_match(predicted: str | None, answer: str) -> bool:
    """`answer_verdict` with a timeout read as wrong."""
    return answer_verdict(predicted, answer) is True


def final_answer(messages: list[dict]) -> str | None:
    """The last \\boxed{} of the last assistant message (None if there is none)."""
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            return last_boxed(m.get("content"))
    return None


@dataclass
class Episode:
    messages: list[dict]  # initial chat: system + user
    answer: str  # the row's ground truth
    wrong_reward: float = WRONG_REWARD
    tools: list = field(default_factory=list)  # no tools in this env
    reward_timeouts: int = 0  # answers whose check overran the deadline (scored wrong); for metrics

    def reward(self, messages: list[dict], tool_calls: list) -> float:
        """1.0 when the final \\boxed{} answer matches, else `wrong_reward`; never raises."""
        verdict = answer_verdict(final_answer(messages), self.answer)
        self.reward_timeouts += verdict is None
        return 1.0 if verdict else self.wrong_reward


def make_episode(row: dict, wrong_reward: float = WRONG_REWARD) -> Episode:
    """One episode for a row with `question` and `answer` (see envs/data.py)."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": row["question"]},
    ]
    return Episode(messages=messages, answer=str(row["answer"]), wrong_reward=wrong_reward)
