"""Tool-free math: the question, one final answer, reward 1 if it matches (`--env math`).

Same data and reward as `envs/retool.py` without the interpreter, so "with tool" vs "without tool"
(ReTool's central comparison) is one flag apart. The reward helpers here are shared with retool.

The final answer is read in the forms the common math RL datasets ask for, the last one given in the
message winning: `\\boxed{x}` (our prompt, MATH), a line `Answer: x` (DAPO-Math-17k's prompt asks for
it as the last line), `#### <number>` (GSM8K).
"""

import re
from dataclasses import dataclass, field
from typing import Any

from envs import verify

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
WRONG_REWARD = 0.0  # reward for a wrong or missing answer; -1.0 is the DAPO/verl/slime convention
MAX_ANSWER_CHARS = 1000  # math-verify parses with sympy, which can hang on huge inputs; longer is wrong


# `\boxed {x}` is `\boxed{x}`: LaTeX skips the blanks before an argument.
_BOX = re.compile(r"\\(?:boxed|fbox)\s*+\{")


def _last_box(text: str) -> re.Match | None:
    """The opening of the last box in `text`, up to its brace."""
    box = None
    for box in _BOX.finditer(text):  # noqa: B007 (the loop only finds the last match)
        pass
    return box


def last_boxed(text: Any) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, with nested braces (escaped ones,
    `\\{`, are text); None if absent or unbalanced."""
    if not isinstance(text, str) or (box := _last_box(text)) is None:
        return None
    return _box_content(text, box)


def _box_content(text: str, box: re.Match) -> str | None:
    """What the box opened by `box` holds, to its balancing brace; None if unbalanced."""
    i = j = box.end()
    depth = 1
    while j < len(text):
        if text[j] == "\\":  # `\{`, `\}` print a brace (`\left\{ … \right.`): no group opens or closes
            j += 1
        elif text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
        j += 1
    return None


# A line that starts (after markdown: "**Answer:**", "> ", "## ") with "Answer:" or "Final answer:".
# Each captures the rest of the line whole and `last_answer` trims it in Python: a lazy `(.*?)` before
# `[ \t]*$` retries the trailing-blank run at every character, quadratic in a run of blanks followed by
# anything else on the line, and a model can write that (Qwen's vocabulary has a 128-space token, so
# 1,900 tokens took minutes, holding the GIL, before any deadline applies).
_ANSWER_LINE = re.compile(r"^[ \t>*_#]*(?:final[ \t]+)?answer[ \t*_]*:([^\n]*)", re.I | re.M)
_GSM8K_LINE = re.compile(r"####([^\n]*)")
# GSM8K's answer is a number, and only a number counts: `#### Verification` or `#### 2. Check` is a
# markdown heading (Qwen writes them after its boxed answer), not an answer that replaces it. envs/data.py
# reads a dataset's `####` ground truth by the same rule.
GSM8K_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?(?:/[0-9]+)?")


_DELIMITERS = (("$", "$"), ("`", "`"), ("\\[", "\\]"), ("\\(", "\\)"))  # math and code markup


def _clean(answer: str, gsm8k: bool) -> str:
    """`$x$`, `` `x` ``, `\\[x\\]`, `\\(x\\)` -> `x`, a trailing full stop dropped; GSM8K's `1,072` ->
    `1072` (as envs/data.py reads its ground truth)."""
    answer = answer.strip().rstrip(".").strip().strip("*_").strip()
    for left, right in _DELIMITERS:
        if len(answer) >= len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
            answer = answer[len(left) : -len(right)].strip()
            break
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer) if gsm8k else answer


def last_answer(text: Any) -> str | None:
    """The final answer in `text`: of its last `\\boxed{}`, its last `Answer:` line and its last
    `#### <number>`, the one that starts last (`Answer: \\boxed{5}` gives 5); None if there is none."""
    if not isinstance(text, str):
        return None
    found = []  # (start, answer)
    if (box := _last_box(text)) is not None and (boxed := _box_content(text, box)) is not None:
        found.append((box.start(), boxed))
    line = None
    for line in _ANSWER_LINE.finditer(text):  # noqa: B007 (the loop only finds the last match)
        pass
    # Empty once cleaned (`Answer:` ended by \r\n, `Answer: $ $`): a heading, no answer.
    if line is not None and (answer := _clean(line.group(1).strip(" \t*_"), False)):
        found.append((line.start(), answer))
    for line in _GSM8K_LINE.finditer(text):  # those that are a number (headings are not): the last wins
        if GSM8K_NUMBER.fullmatch(number := _clean(line.group(1), True)):
            found.append((line.start(), number))
    return max(found)[1] if found else None


# LaTeX spacing between digit groups (`4\\,517\\,277`, SI style): a space in the typeset number, which
# math-verify did not read as one number, so a right answer written so scored wrong.
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\[,;: ]|~)(?=\d{3}(?!\d))")


# A plain number in scientific notation (`1e-05`, `2.5E3`), which math-verify read with e as Euler's
# number (`1e-05` as e - 5, `2e3` as 6e): 0.00001 written 1e-05 scored wrong, and `e-05` right against
# a gold of 1e-05. Rewritten as LaTeX's `1\times 10^{-5}`: exact, where a decimal would meet
# math-verify's 6-digit rounding (1e-7 = 2e-7), and as short as written, whatever the exponent.
_SCIENTIFIC = re.compile(r"\s*([+-]?\d+(?:\.\d+)?)[eE]([+-]?)(\d+)\s*", re.ASCII)


def _scientific_as_latex(text: str) -> str:
    """`text` as `m\\times 10^{k}` when it is a number in scientific notation, else unchanged; `e`,
    `2e` and `e^{2}` keep Euler's e."""
    if (number := _SCIENTIFIC.fullmatch(text)) is None:
        return text
    mantissa, sign, exponent = number.groups()
    return f"{mantissa}\\times 10^{{{sign.strip('+')}{exponent.lstrip('0') or '0'}}}"


def answer_verdict(predicted: str | None, answer: str) -> bool | None:
    """math-verify equivalence (fractions, LaTeX, 1/2 vs 0.5, `10\\,000` vs 10000, 1e-5 vs 0.00001);
    False on anything it cannot parse, None when checking overran `envs.verify.DEADLINE_S` (score it
    wrong, count it)."""
    if predicted is None or len(predicted) > MAX_ANSWER_CHARS:
        return False
    predicted, answer = _DIGIT_GROUP_SPACE.sub("", predicted), _DIGIT_GROUP_SPACE.sub("", answer)
    predicted, answer = _scientific_as_latex(predicted), _scientific_as_latex(answer)
    if predicted.strip() == answer.strip():
        return True  # fast path, and robust when math-verify cannot parse both sides
    return verify.check(answer, predicted)


def answers_match(predicted: str | None, answer: str) -> bool:
    """`answer_verdict` with a timeout read as wrong."""
    return answer_verdict(predicted, answer) is True


def final_answer(messages: list[dict]) -> str | None:
    """The final answer of the last assistant message (`last_answer`; None if there is none), read
    after its reasoning: a hermes turn's content keeps Qwen3's `<think>…</think>`, which the template
    does not show as the reply (a `\\boxed{}` only in there was rewarded; harmony's `thinking` never
    was), and one cut off inside it has no reply at all."""
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            content = m.get("content")
            if isinstance(content, str):  # after the last `</think>`, before a `<think>` never closed
                content = content.rsplit("</think>", 1)[-1].split("<think>", 1)[0]
            return last_answer(content)
    return None


@dataclass
class Episode:
    messages: list[dict]  # initial chat: system + user
    answer: str  # the row's ground truth
    wrong_reward: float = WRONG_REWARD
    tools: list = field(default_factory=list)  # no tools in this env
    reward_timeouts: int = 0  # answers whose check overran the deadline (scored wrong); for metrics

    def reward(self, messages: list[dict], tool_calls: list) -> float:
        """1.0 when the final answer matches, else `wrong_reward`; never raises."""
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
