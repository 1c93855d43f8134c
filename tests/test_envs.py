"""envs/: load_env, rewards (math-verify equivalences, garbage), the retool tool, data loading, generator."""

import asyncio
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from envs import load_env, verify
from envs.confine import MEMORY_LIMIT_BYTES, ROLLOUT_CPUS_ENV
from envs.data import load_datasets, load_rows
from envs.math_env import answers_match, last_answer, last_boxed
from envs.retool import ran_ok, strip_fence
from envs.sandbox import SandboxResult

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Call:  # the shape of the rollout worker's tool-call records
    name: str
    arguments: dict
    result: str
    failed: bool


def final(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


def test_load_env():
    assert load_env("retool").__name__ == "envs.retool"
    assert load_env("math").__name__ == "envs.math_env"
    with pytest.raises(ValueError, match="available: math, retool"):
        load_env("nope")


@pytest.mark.parametrize("env", ["retool", "math"])
def test_episode_shape(env):
    mod = load_env(env)
    ep = mod.make_episode({"question": "What is 2 * 3?", "answer": "6"})
    assert [m["role"] for m in ep.messages] == ["system", "user"]
    assert ep.messages[0]["content"] == mod.SYSTEM_PROMPT and "\\boxed" in mod.SYSTEM_PROMPT
    assert ep.messages[1]["content"] == "What is 2 * 3?" and ep.answer == "6"
    assert len(ep.tools) == (1 if env == "retool" else 0)


@pytest.mark.parametrize(
    ("pred", "gold", "ok"),
    [
        ("6", "6", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "0.5", True),
        ("\\dfrac{3}{4}", "0.75", True),
        ("4,517,277", "4517277", True),
        ("x^{2}", "x^2", True),
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
        ("7", "6", False),
        ("", "6", False),
        ("}{", "6", False),
        ("\\frac{", "6", False),
        ("9" * 5000, "6", False),
    ],
)
def test_answers_match(pred, gold, ok):
    assert answers_match(pred, gold) is ok


def test_last_boxed():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed{unbalanced") is None
    assert last_boxed(None) is None and last_boxed("no box") is None


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so \\boxed{5}", "5"),  # ours and MATH's
        ("Working.\nAnswer: 42", "42"),  # DAPO-Math-17k's last line
        ("Working.\n**Answer:** $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("Final answer: 9", "9"),
        ("3 + 4 = 7\n#### 1,072", "1072"),  # GSM8K, its thousands separator read as envs/data.py reads gold
        ("\\boxed{3}\nAnswer: 4", "4"),  # the last one given wins, whichever form
        ("Answer: 4\nno, \\boxed{3}", "3"),
        ("#### 8\nAnswer: 9", "9"),
        ("Answer: 9\n#### 8", "8"),
        ("Answer: \\boxed{7}", "7"),
        ("\\boxed{unbalanced\nAnswer: 6", "6"),
        ("the answer: 5", None),  # not a line of its own
        ("so x = \\boxed{5}.\n\n#### Verification\n5 + 2 = 7", "5"),  # a markdown heading is no answer
        ("x = \\boxed{7}.\n\n#### 2. Check\n7 + 2 = 9", "7"),
        ("#### 72\n\n#### Check", "72"),  # the last #### that is a number
        ("#### -3/4", "-3/4"),
        ("Answer: \\[34\\]", "34"),  # display math, inline math, code
        ("Answer: \\(\\frac{1}{2}\\)", "\\frac{1}{2}"),
        ("**Answer:** `34`", "34"),
        ("Answer: **", None),
        ("Answer:", None),
    ],
)
def test_last_answer_reads_the_forms_math_datasets_ask_for(text, answer):
    assert last_answer(text) == answer


@pytest.mark.parametrize(
    "text, answer",
    [
        ("Answer: 5" + " " * 128 * 500 + "x", "5" + " " * 128 * 500 + "x"),  # Qwen has a 128-space token
        ("**Answer:** 5" + "\t " * 32_000 + "x\nok", "5" + "\t " * 32_000 + "x"),
        ("#### 7" + " " * 64_000 + "8", None),  # not a number: no answer
        ("Answer: 5" + " " * 64_000 + "\n#### 6" + "\t" * 64_000, "6"),
    ],
    ids=["answer_line", "markdown_tabs", "gsm8k", "trailing_blanks"],
)
def test_a_long_run_of_blanks_in_an_answer_line_is_read_in_linear_time(text, answer):
    """A blank run followed by more text on the line made the old lazy-capture regexes quadratic: the
    first three 64k-character lines took 17 s each, holding the GIL inside the reward thread (a
    1,900-token completion of Qwen's 128-space token: 174 s); the last checks that trailing blanks are
    still trimmed. Now each takes about a millisecond. The clock is this thread's CPU time, so other
    processes on a shared machine do not count; the 1 s bound is a thousand times the linear cost and
    a seventeenth of the quadratic one, and the answer is the one the old regexes gave."""
    t0 = time.thread_time()
    assert last_answer(text) == answer
    assert time.thread_time() - t0 < 1.0


@pytest.mark.parametrize("env", ["math", "retool"])
def test_the_answer_is_read_after_the_reasoning(env):
    """Qwen3's turn keeps its `<think>…</think>` in the content (the template does not show it as the
    reply): a box only in there is no answer, one after it is; with the opening tag in the prompt
    (enable_thinking) the content has the closing one alone."""
    ep = load_env(env).make_episode({"question": "q", "answer": "12"})
    assert ep.reward(final("<think>\nIs it \\boxed{12}?\n</think>\n\nI am not sure."), []) == ep.wrong_reward
    assert ep.reward(final("<think>\n\\boxed{3}\n</think>\n\nSo \\boxed{12}."), []) == 1.0
    assert ep.reward(final("Is it 12?\n</think>\n\nAnswer: 12"), []) == 1.0


@pytest.mark.parametrize("env", ["math", "retool"])
def test_a_box_in_reasoning_cut_off_before_its_end_is_no_answer(env):
    """A Qwen3 turn cut off by the length limit opens `<think>` and never closes it: all of it is
    reasoning, and a box in there is no more the reply than one before a `</think>` (it was rewarded, so
    a box early in a ramble to the limit paid)."""
    ep = load_env(env).make_episode({"question": "q", "answer": "12"})
    assert ep.reward(final("<think>\nIs it \\boxed{12}? Let me check that by"), []) == ep.wrong_reward
    assert ep.reward(final("<think>\nAnswer: 12\n#### 12"), []) == ep.wrong_reward
    assert ep.reward(final("<think>a</think>\n\\boxed{3}\n<think>\\boxed{12}"), []) == ep.wrong_reward
    assert ep.reward(final("\\boxed{12}\n<think>\nhm"), []) == 1.0  # given before the reasoning opened


def test_a_dapo_answer_line_is_rewarded():
    ep = load_env("retool").make_episode({"question": "q", "answer": "34"})
    assert ep.reward(final("x = 34, so\nAnswer: 34"), []) == 1.0
    assert ep.reward(final("\\boxed{34}\nAnswer: 35"), []) == 0.0


@pytest.mark.parametrize("env", ["retool", "math"])
def test_reward(env):
    ep = load_env(env).make_episode({"question": "q", "answer": "\\frac{1}{2}"})
    assert ep.reward(final("so \\boxed{0.5}"), []) == 1.0
    assert ep.reward(final("\\boxed{0.4}"), []) == 0.0
    # Only the last assistant message counts.
    msgs = final("\\boxed{0.5}") + [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "hmm"}]
    assert ep.reward(msgs, []) == 0.0
    for garbage in [None, "", "\\boxed{" * 10_000, "}" * 10**6, "\\boxed{" + "1" * 10**6 + "}", "\x00\xff"]:
        assert ep.reward(final(garbage), []) == 0.0
    assert ep.reward([], []) == 0.0
    assert ep.reward([{"role": "assistant"}, "not a dict"], []) == 0.0
    strict = load_env(env).make_episode({"question": "q", "answer": "1"}, wrong_reward=-1.0)
    assert strict.reward(final("\\boxed{2}"), []) == -1.0


@pytest.mark.parametrize(
    ("gold", "boxed", "reward"),
    [
        ("0.00001", "1e-05", 1.0),
        ("1e-5", "0.00001", 1.0),
        ("2e3", "2000", 1.0),
        ("2000", "2e3", 1.0),
        ("1.5e-3", "\\frac{3}{2000}", 1.0),
        ("-1E+2", "-100", 1.0),
        ("1e-05", "e-05", 0.0),  # e - 5 is not 1e-5
        ("1e-7", "2e-7", 0.0),  # as a decimal, math-verify's 6-digit rounding called these equal
        ("2e3", "2e", 0.0),
        ("e", "e", 1.0),  # Euler's e keeps its meaning: only <number>e<integer> is a number
        ("e", "2.718281828", 1.0),
        ("2e", "5.43656365691809", 1.0),
        ("e^{2}", "e^2", 1.0),
    ],
)
@pytest.mark.parametrize("env", ["retool", "math"])
def test_scientific_notation_is_a_number_not_eulers_e(env, gold, boxed, reward):
    """It was read by math-verify as Euler's e: `1e-05` parsed as E - 5 and `2e3` as 6E, so 0.00001
    written 1e-05 scored wrong against 0.00001, and `e-05` scored right against a gold of 1e-05."""
    ep = load_env(env).make_episode({"question": "q", "answer": gold})
    assert ep.reward(final(f"so \\boxed{{{boxed}}}"), []) == reward


def test_reward_in_a_thread():
    # math-verify's own timeouts use SIGALRM, which fails off the main thread; ours must not.
    ep = load_env("math").make_episode({"question": "q", "answer": "\\frac{1}{2}"})
    out = []
    t = threading.Thread(target=lambda: out.append(ep.reward(final("\\boxed{0.5}"), [])))
    t.start()
    t.join()
    assert out == [1.0]


def test_tool_bonus():
    retool = load_env("retool")
    ok, bad = Call("code_interpreter", {}, "1", False), Call("code_interpreter", {}, "", True)
    ep = retool.make_episode({"question": "q", "answer": "6"}, wrong_reward=-1.0, tool_bonus=0.1)
    assert ep.reward(final("\\boxed{5}"), [ok, bad]) == pytest.approx(-0.9)  # failed calls don't count
    assert ep.reward(final("\\boxed{5}"), [ok] * 10) == pytest.approx(-0.6)  # capped
    assert ep.reward(final("\\boxed{6}"), [ok] * 10) == 1.0  # right answers get no bonus
    plain = retool.make_episode({"question": "q", "answer": "6"})
    assert plain.reward(final("\\boxed{5}"), [ok]) == 0.0  # off by default


def test_a_run_that_failed_earns_no_tool_bonus():
    """The worker marks a call failed only when it could not run it; code that raised, exited nonzero
    or timed out is a result the model reads, and no tool use worth a bonus. The results are what the
    interpreter returns for such runs (`format_result`; test_code_interpreter runs real ones), built
    here without starting a sandbox, which the quick test pass refuses."""
    retool = load_env("retool")
    ep = retool.make_episode({"question": "q", "answer": "6"}, wrong_reward=-1.0, tool_bonus=0.1)

    def run(output, exit_code=0, timed_out=False, error=""):
        r = SandboxResult(output, exit_code, timed_out, truncated=False, duration_s=0.0, error=error)
        return retool.format_result(r, ep.timeout_s)

    results = [
        run("1\n"),
        run(""),  # "[no output; ...]": it ran
        run("Traceback ...\nZeroDivisionError: division by zero\n", 1),
        run("", 3),
        run("", 137, error="killed by signal 9 (SIGKILL)"),
        run("partial\n", 137, timed_out=True),
    ]
    assert [ran_ok(r) for r in results] == [True, True, False, False, False, False]
    calls = [Call("code_interpreter", {"code": "..."}, r, False) for r in results]
    assert ep.reward(final("\\boxed{5}"), calls) == pytest.approx(-0.8)  # the two that ran
    assert ep.reward(final("\\boxed{5}"), calls[2:]) == -1.0
    # A failure note is the last line; code can print one (forfeiting its own bonus) but not hide one.
    assert not ran_ok("42\n[exit code 1]") and ran_ok("[exit code 1]\n42")


def test_tool_schema():
    ep = load_env("retool").make_episode({"question": "q", "answer": "6"})
    schema = get_json_schema(ep.tools[0])
    fn = schema["function"]
    assert fn["name"] == "code_interpreter" and fn["description"]
    assert fn["parameters"]["required"] == ["code"]
    assert fn["parameters"]["properties"]["code"]["type"] == "string"


def test_strip_fence():
    assert strip_fence("```python\nprint(1)\n```") == "print(1)\n"
    assert strip_fence("Here:\n```py\nx = 2\n```\n") == "x = 2\n"
    assert strip_fence("```\nprint(3)\n```") == "print(3)\n"
    assert strip_fence("```python3\nx = 5\n```") == strip_fence("```Python\nx = 5\n```") == "x = 5\n"
    assert strip_fence("```python\nx = 6\n") == "x = 6\n"  # cut off by the length limit
    assert strip_fence('```python\nprint("```")\nx = 7\n```') == 'print("```")\nx = 7\n'
    table = 't = """```\n| n |\n```"""\nprint(t)\n'  # unfenced code holding a fence
    assert strip_fence(table) == table
    assert strip_fence("print(4)") == "print(4)"


def test_code_interpreter():
    ep = load_env("retool").make_episode({"question": "q", "answer": "6"})
    tool = ep.tools[0]
    assert asyncio.run(tool(code="```python\nprint(4821 * 937)\n```")) == "4517277\n"
    out = asyncio.run(tool(code="1 / 0"))
    assert "ZeroDivisionError" in out and "[exit code 1]" in out
    assert "no output" in asyncio.run(tool(code="x = 1"))
    ep.timeout_s = 1.0
    assert "[timed out after 1 s" in asyncio.run(tool(code="while True: pass"))
    # A fence indented as models write one inside a list item (its code indented with it) runs as the
    # code, not as an IndentationError: the interpreter path the env uses, through the real sandbox.
    ep.timeout_s = 10.0
    listed = "1. Multiply:\n   ```python\n   for n in [937]:\n       print(4821 * n)\n   ```\n"
    assert asyncio.run(tool(code=listed)) == "4517277\n"


def test_episodes_are_isolated():
    retool = load_env("retool")
    a = retool.make_episode({"question": "qa", "answer": "1"}, tool_bonus=0.1)
    b = retool.make_episode({"question": "qb", "answer": "2"})
    assert a.tools[0] != b.tools[0] and a.messages is not b.messages
    a.messages.append({"role": "assistant", "content": "x"})
    assert len(b.messages) == 2 and b.tool_bonus == 0.0 and b.answer == "2"
    # Interpreter state does not carry over between calls either.
    asyncio.run(a.tools[0](code="open('f', 'w').write('1'); x = 5"))
    assert "NameError" in asyncio.run(a.tools[0](code="print(x)"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_load_rows_layouts(tmp_path):
    plain = write_jsonl(
        tmp_path / "p.jsonl", [{"question": "1+1?", "answer": 2}, {"problem": "p", "solution": "s"}]
    )
    assert [(r["question"], r["answer"]) for r in load_rows(plain)] == [("1+1?", "2"), ("p", "s")]
    gsm = write_jsonl(tmp_path / "g.jsonl", [{"question": "How many?", "answer": "3 + 4 = 7\n#### 1,072"}])
    assert load_rows(gsm)[0]["answer"] == "1072"
    dapo_row = {
        "prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Find x."}],
        "reward_model": {"ground_truth": "34", "style": "rule"},
        "data_source": "math_dapo",
    }
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([dapo_row]), tmp_path / "d.parquet")
    row = load_rows(str(tmp_path / "d.parquet"))[0]
    assert (row["question"], row["answer"], row["data_source"]) == ("Find x.", "34", "math_dapo")


def test_load_rows_bad_rows(tmp_path):
    no_answer = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "1"}, {"question": "q2"}])
    with pytest.raises(ValueError, match=r"row 1: no answer"):
        load_rows(no_answer)
    no_question = write_jsonl(tmp_path / "b.jsonl", [{"prompt": [], "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 0: no question"):
        load_rows(no_question)
    (tmp_path / "c.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        load_rows(str(tmp_path / "c.csv"))


@pytest.mark.parametrize("line", ['["1+1?", "2"]', "null", '"1+1?"', "3"])
def test_a_line_that_is_not_an_object_is_named(tmp_path, line):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q", "answer": "1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"^line 2: {re.escape(line)} is not a JSON object; write one"):
        load_rows(str(path))
    # And in the one line training start-up prints, naming the flag and the file.
    with pytest.raises(ValueError, match=rf"^--dataset {re.escape(str(path))}: line 2: .* not a JSON object"):
        load_datasets(str(path), None, 0)


def test_an_answer_list_of_one_is_its_answer_and_a_longer_one_is_refused(tmp_path):
    rows = [
        {"question": "q", "answer": ["5"]},
        {"question": "q", "reward_model": {"ground_truth": [7]}},
        {"question": "q", "answer": ["6", "7"]},
    ]
    assert [r["answer"] for r in load_rows(write_jsonl(tmp_path / "a.jsonl", rows[:2]))] == ["5", "7"]
    for i, bad in [(2, ["6", "7"]), (2, []), (2, {"x": 1})]:
        path = write_jsonl(tmp_path / "b.jsonl", rows[:2] + [{"question": "q", "answer": bad}])
        with pytest.raises(
            ValueError, match=rf"^row {i}: answer is a (list|dict) .*give a string or a number"
        ):
            load_rows(path)
    ep = load_env("math").make_episode(load_rows(write_jsonl(tmp_path / "c.jsonl", rows[:1]))[0])
    assert ep.reward(final("\\boxed{5}"), []) == 1.0


def test_a_file_that_cannot_be_read_is_named_with_its_problem(tmp_path):
    """A missing parquet file said only its own name (`--dataset x.parquet: x.parquet`); a byte that is
    not UTF-8 (a file saved as Latin-1) named no line, and the position it gave was in a read buffer."""
    missing = str(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match=rf"^--dataset {re.escape(missing)}: .*No such file or directory"):
        load_datasets(missing, None, 0)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(
        b'{"question": "q", "answer": "1"}\n' * 1000
        + '{"question": "café?", "answer": "2"}\n'.encode("latin-1")
    )
    with pytest.raises(ValueError, match=r"^line 1001: not JSON \('utf-8' codec can't decode byte 0xe9"):
        load_rows(str(latin1))


def test_a_nan_answer_is_no_answer(tmp_path):
    """NaN is how pandas marks a missing value (json.dumps writes it as `NaN`): it was read as the
    answer "nan", which no completion matches, so the row trained on a reward of wrong for all."""
    path = tmp_path / "n.jsonl"
    path.write_text('{"question": "q", "answer": 1.5}\n{"question": "q2", "answer": NaN}\n')
    with pytest.raises(ValueError, match=r"^row 1: no answer"):
        load_rows(str(path))


def test_a_numeric_answer_is_its_decimal_digits(tmp_path):
    """JSON numbers as ground truth: small and large floats without an exponent (math-verify reads
    `1e-05` as Euler's e minus 5), so the right answer scores and e - 5 does not."""
    rows = [{"question": "q", "answer": a} for a in (1e-05, 1e16, 0.5, 72.0, 3)]
    golds = [r["answer"] for r in load_rows(write_jsonl(tmp_path / "n.jsonl", rows))]
    assert golds == ["0.00001", "10000000000000000", "0.5", "72.0", "3"]
    assert answers_match("0.00001", golds[0]) and not answers_match("e-5", golds[0])


def test_shipped_data_and_generator(tmp_path):
    train, test = load_rows("data/retool_train.jsonl"), load_rows("data/retool_test.jsonl")
    assert (len(train), len(test)) == (2000, 200)
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert {r["kind"] for r in train} == {"product", "power_mod", "range_sum"}
    for r in train[:50]:
        if r["kind"] == "product":
            a, b = r["question"].removeprefix("What is ").removesuffix("?").split(" * ")
            assert int(r["answer"]) == int(a) * int(b)
    # Deterministic: regenerating gives the shipped files byte for byte.
    subprocess.run([sys.executable, "scripts/make_retool_data.py", "--out-dir", str(tmp_path)], check=True)
    for name in ["retool_train.jsonl", "retool_test.jsonl"]:
        assert (tmp_path / name).read_bytes() == open(f"data/{name}", "rb").read()


# ---------------------------------------------------------------------------------------------------
# Rewards never hang: math-verify in worker processes with a hard deadline per answer (envs/verify.py)
# ---------------------------------------------------------------------------------------------------
DEADLINE_S = 1.0  # short, so the tests take seconds
SLACK_S = 2.0  # a killed worker's replacement starts (sympy import) before the next answer
ADVERSARIAL = [
    "9^{9^{9^{9}}}",  # power tower: sympy evaluates the big int in C, forever
    "(10^{10})!",
    "100000!",
    "\\sqrt{" * 120 + "2" + "}" * 120,  # deeply nested LaTeX (under MAX_ANSWER_CHARS)
    "(" * 450 + "1" + ")" * 450,
    "7" * 1_000_000,  # a megabyte string
]


@pytest.fixture
def short_deadline(monkeypatch):
    monkeypatch.setattr(verify, "DEADLINE_S", DEADLINE_S)


def verify_children() -> list[int]:
    """Pids of this process's answer-checking workers."""
    return children_running(os.getpid(), "verify.py")


def children_running(pid: int, needle: str) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if needle in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")]


def test_adversarial_answers_return_within_the_deadline_and_score_wrong(short_deadline):
    ep = load_env("math").make_episode({"question": "q", "answer": "5"})
    batch = [("5.0", 1.0), ("6", 0.0)] + [(a, 0.0) for a in ADVERSARIAL] + [("\\frac{10}{2}", 1.0)]
    for pred, want in batch:
        assert verify.pool().check("1", "1")  # a worker is idle now: the answer takes the last idle one
        worker, timeouts = verify.pool().pids()[-1], ep.reward_timeouts
        t0 = time.monotonic()
        got = ep.reward(final(f"\\boxed{{{pred}}}"), [])
        took = time.monotonic() - t0
        assert got == want, pred[:30]
        assert took < DEADLINE_S + SLACK_S, (pred[:30], took)
        # The overrun worker is gone (killed and reaped, not a zombie); one that answered stays.
        overran = ep.reward_timeouts > timeouts
        assert Path(f"/proc/{worker}").exists() != overran, (pred[:30], worker, overran)
    assert ep.reward_timeouts >= 2  # the power tower and (10^10)! at least; the rest fail fast or time out


def test_a_worker_killed_mid_answer_is_replaced(short_deadline):
    assert answers_match("\\frac{1}{2}", "0.5")  # the pool is up
    out = []
    t = threading.Thread(target=lambda: out.append(verify.pool().check("5", "9^{9^{9^{9}}}", deadline_s=30)))
    t.start()
    time.sleep(0.5)  # the worker is deep in sympy
    for pid in verify_children():
        os.kill(pid, signal.SIGKILL)
    t.join(timeout=5)
    assert out == [None]  # scored as not answered, well before its 30 s deadline
    assert answers_match("\\frac{1}{2}", "0.5") and not answers_match("3", "0.5")


def test_an_answer_that_eats_memory_stops_at_the_workers_limit():
    """`(x+1)^{10^{9}}` makes sympy expand the power: about 550 MB a second here, so the deadline alone
    let a worker reach --reward-timeout times that (1.7 GB at the default 3 s, 16 GB at 30 s, per
    worker). Now its address space is capped at MEMORY_LIMIT_BYTES: math-verify meets a MemoryError,
    scores the answer wrong well before the deadline, and the worker goes on answering. RSS is part of
    the address space, so the peak is bounded exactly; the watcher kills a worker past it so a failing
    run does not eat the machine. The same cap bounds what answers that finish leave in sympy's caches
    (each `2^{2*10^8+k}` left 100 MB behind: 2.6 GB after 24 of them, now at most the cap)."""
    pool = verify.VerifyPool(size=1)
    assert pool.check("1", "1") is True
    (pid,) = pool.pids()
    done, peak, over = threading.Event(), [0], []

    def watch():
        while not done.wait(0.05):
            try:
                status = dict(
                    line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                )
            except OSError:
                return
            peak[0] = max(peak[0], int(status["VmHWM"].split()[0]) * 1024)
            if peak[0] > MEMORY_LIMIT_BYTES:
                over.append(peak[0])
                os.kill(pid, signal.SIGKILL)
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert pool.check("5", "(x+1)^{10^{9}}", deadline_s=120) is False  # answered, not killed
    finally:
        done.set()
        watcher.join()
    assert not over and 0 < peak[0] <= MEMORY_LIMIT_BYTES
    assert pool.check("\\frac{1}{2}", "0.5") is True and pool.pids() == [pid]  # the same worker
    os.kill(pid, signal.SIGKILL)


def test_a_worker_that_answers_holding_much_memory_is_replaced():
    """Answers that finish leave what sympy computed in its caches (each `2^{2*10^8+k}` ~100 MB): the
    worker that answered 3 of them held ~390 MB, and after ~20 sat at its address-space cap for good.
    One left holding more than RECYCLE_BYTES is replaced, and the next answer is judged by a fresh one."""
    pool = verify.VerifyPool(size=1)
    assert pool.check("1", "1") is True
    (first,) = pool.pids()
    for k in range(3):
        assert pool.check("1", f"2^{{{2 * 10**8 + k}}}", deadline_s=60) is False
        assert [verify._resident_bytes(pid) <= verify.RECYCLE_BYTES for pid in pool.pids()] in ([], [True])
    assert first not in pool.pids() and not os.path.exists(f"/proc/{first}")  # killed and reaped
    assert pool.check("\\frac{1}{2}", "0.5") is True
    for pid in pool.pids():
        os.kill(pid, signal.SIGKILL)


def test_answers_are_checked_in_a_process_holding_over_1024_files():
    """select() refuses a descriptor of 1024 or more (ValueError out of the reward, and a worker left
    running), and a trainer or rollout process with many connections, pipes and files holds that many
    where its open-files limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the open-files limit ({hard}) keeps descriptors under 1024")
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (max(soft, 1100) if soft != resource.RLIM_INFINITY else soft, hard)
    )
    held = [os.open(os.devnull, os.O_RDONLY)]
    pool = verify.VerifyPool(size=1)
    try:
        while held[-1] < 1024:  # the lowest free descriptors go first: the worker's pipes get higher ones
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert pool.check("\\frac{1}{2}", "0.5") is True and pool.check("3", "0.5") is False
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_scoring_from_two_threads_at_once():
    # The default deadline, not short_deadline's 1 s: in make test's niced quick pass beside two streams a
    # fresh worker's first honest answer (~16 ms of CPU) once took over 1 s and scored False. What this
    # asserts is the verdicts of two threads at once, not how soon the power tower is cut off.
    cases = [("0.5", "\\frac{1}{2}", True), ("2", "\\frac{1}{2}", False), ("9^{9^{9^{9}}}", "1", False)]
    results: dict[int, list] = {}

    def score(i):
        results[i] = [answers_match(p, g) for p, g, _ in cases * 2]

    threads = [threading.Thread(target=score, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {i: [ok for _, _, ok in cases * 2] for i in range(2)}
    # ...and from an event loop, off the loop, as the rollout worker and eval do.
    ep = load_env("retool").make_episode({"question": "q", "answer": "1/2"})
    rewards = asyncio.run(asyncio.wait_for(asyncio.to_thread(ep.reward, final("\\boxed{0.5}"), []), 30))
    assert rewards == 1.0


def test_no_timeout_warnings_and_no_orphans_after_sigkill_of_the_parent():
    # A fresh interpreter so its stderr holds everything the pool's workers print.
    script = (
        "import sys, threading; from envs import verify; from envs.math_env import answers_match\n"
        "print(answers_match('\\\\frac{1}{2}', '0.5'), flush=True)\n"
        "threading.Thread(target=verify.pool().check, args=('5', '9^{9^{9^{9}}}', 600)).start()\n"
        "threading.Thread(target=verify.pool().check, args=('5', '(10^{10})!', 600)).start()\n"
        "print('hanging', flush=True); threading.Event().wait()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "True\n"
        assert proc.stdout.readline() == "hanging\n"
        deadline = time.monotonic() + 60
        while len(workers := children_running(proc.pid, "verify.py")) < 2:  # both busy in sympy
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while alive := [w for w in workers if Path(f"/proc/{w}").exists() and not is_zombie(w)]:
        assert time.monotonic() < deadline, f"answer-checking workers {alive} outlived their parent"
        time.sleep(0.1)
    assert "Timeout is disabled" not in proc.stderr.read()  # after the workers are gone: EOF


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_answer_workers_run_on_the_rollout_cpus(monkeypatch):
    """--rollout-cpus: an answer-checking worker pins itself to the rollout CPUs even when the pool is
    started from a thread that runs elsewhere (the trainer's, for the eval at start-up)."""
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    monkeypatch.setenv(ROLLOUT_CPUS_ENV, str(cpu))
    pool = verify.VerifyPool(size=1)
    assert pool.check("1", "1") is True
    (pid,) = pool.pids()
    try:
        assert os.sched_getaffinity(pid) == {cpu}
        assert os.sched_getaffinity(0) == allowed
    finally:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("env", ["math", "retool"])
def test_latex_thin_space_digit_groups_are_one_number(env):
    """`4\\,517\\,277` is how LaTeX groups digits (SI style, and how models trained on it write large
    results): math-verify read it as something other than 4517277, so a right product scored wrong, in
    either direction (a dataset's gold written `10\\,000`)."""
    ep = load_env(env).make_episode({"question": "What is 4821 * 937?", "answer": "4517277"})
    for written in ["4\\,517\\,277", "4\\;517\\;277", "4\\ 517\\ 277", "4~517~277", "Answer: 4\\,517\\,277"]:
        text = written if written.startswith("Answer") else f"so \\boxed{{{written}}}"
        assert ep.reward(final(text), []) == 1.0, written
    assert ep.reward(final("\\boxed{4\\,517\\,278}"), []) == 0.0
    gold_grouped = load_env(env).make_episode({"question": "q", "answer": "10\\,000"})
    assert gold_grouped.reward(final("\\boxed{10000}"), []) == 1.0
    assert gold_grouped.reward(final("\\boxed{1000}"), []) == 0.0
    assert answers_match("(1,\\,2)", "(1,2)") and not answers_match("(1,\\,2)", "12")


def test_a_markdown_heading_in_a_solution_is_not_a_gsm8k_answer(tmp_path):
    """Only GSM8K's `#### <number>` is its answer: a worked solution (NuminaMath's `solution`) with a
    `#### Part (b)` heading became the text after it with every comma deleted, so `\\boxed{(1, 2)}` in
    the gold read `(1 2)` and the right answer scored wrong."""
    solution = "#### Part (a)\nWe find x = 1.\n\n#### Part (b)\nThen y = 2, so the pair is $\\boxed{(1, 2)}$."
    rows = [
        {"problem": "Find (x, y).", "solution": solution},
        {"question": "How many?", "answer": "3 + 4 = 7\n#### 1,072"},
        {"question": "How much?", "answer": "Half of it.\n#### -3.5"},
    ]
    golds = [r["answer"] for r in load_rows(write_jsonl(tmp_path / "s.jsonl", rows))]
    assert golds == [solution, "1072", "-3.5"]
    ep = load_env("math").make_episode({"question": "q", "answer": golds[0]})
    assert ep.reward(final("\\boxed{(1, 2)}"), []) == 1.0


def test_a_missing_answer_falls_through_to_the_next_column(tmp_path):
    """A file mixing layouts (GSM8K rows with `answer`, MATH rows with `solution`) has both columns in
    every row of a parquet file or a pandas export, the absent one null or NaN: the question fell
    through to the next column but the answer stopped at the null, refusing the row with "no answer
    (looked for 'answer', 'solution', ...)" although its solution was there."""
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        '{"question": "1+1?", "answer": "2", "solution": null}\n'
        '{"problem": "2+2?", "answer": null, "solution": "4"}\n'
        '{"problem": "3+3?", "answer": NaN, "solution": "6"}\n'
        '{"problem": "4+4?", "answer": " ", "reward_model": {"ground_truth": "8"}}\n'
    )
    assert [(r["question"], r["answer"]) for r in load_rows(str(path))] == [
        ("1+1?", "2"),
        ("2+2?", "4"),
        ("3+3?", "6"),
        ("4+4?", "8"),
    ]


@pytest.mark.parametrize(
    "code",
    [
        "```python\r\nx = 6\r\nprint(x * 7)\r\n```",
        "```python\nx = 6\nprint(x * 7)\n```\r\n",
        "Here:\r\n```py \r\nx = 6\r\nprint(x * 7)\r\n```\r\nThat prints it.",
    ],
    ids=["crlf", "crlf_close", "crlf_with_prose"],
)
def test_a_fence_written_with_crlf_line_ends_is_stripped(code):
    """It was not: a fence line ending in `\\r\\n` (JSON's "\\r\\n" in the model's arguments, code written
    on Windows) matched neither the opening nor the closing fence, so the interpreter ran the backticks
    and the model read a SyntaxError for correct code."""
    body = strip_fence(code)
    assert "```" not in body and body.replace("\r\n", "\n") == "x = 6\nprint(x * 7)\n"
    compile(body, "<code>", "exec")  # Python reads \r\n line ends itself


@pytest.mark.parametrize("code", ["print(4821 * 937)\n```\n", "x = 6\nprint(x * 7)\n```  \n\n"])
def test_a_stray_closing_fence_does_not_discard_the_code(code):
    """It did: a program followed by a closing fence alone (no opening one) read as a fence opening at
    that line and running to the end, so the program became the empty text after it, and the model
    read "[no output; use print() to see values]" for code that prints. The code is kept; Python then
    shows the model the stray backticks."""
    assert strip_fence(code) == code


def test_a_gsm8k_answer_loses_only_its_thousands_separators(tmp_path):
    """It lost every comma: `#### 3,5` (two answers) became the gold `35`, so the model's `#### 3,5`
    (read as `3,5`, as `math_env.last_answer` reads a model's `####`) scored wrong and `#### 35` right.
    A comma goes only before a group of three digits, by the rule the model's answer is read with."""
    rows = [
        {"question": "Which x?", "answer": "x = 3 or x = 5.\n#### 3,5"},
        {"question": "How many?", "answer": "3 + 4 = 7\n#### 1,072"},
        {"question": "How many?", "answer": "#### 1,234,567"},
    ]
    golds = [r["answer"] for r in load_rows(write_jsonl(tmp_path / "g.jsonl", rows))]
    assert golds == ["3,5", "1072", "1234567"]
    ep = load_env("math").make_episode({"question": "q", "answer": golds[0]})
    assert ep.reward(final("x = 3 or x = 5\n#### 3,5"), []) == 1.0
    assert ep.reward(final("#### 35"), []) == 0.0


@pytest.mark.parametrize(
    "code",
    [
        "1. First:\n  ```python\n  x = 6\n  if x:\n      print(x * 7)\n  ```\n",
        "- step\n    ```py\n    x = 6\n\n    if x:\n        print(x * 7)\n    ```",
        "  ```python\r\n  x = 6\r\n\r\n  if x:\r\n      print(x * 7)\r\n  ```\r\n",
        "\t```python\n\tx = 6\n\tif x:\n\t    print(x * 7)\n\t```",
        "   ```python\n   x = 6\n   if x:\n       print(x * 7)\n",  # cut off by the length limit
    ],
    ids=["list_item", "blank_line", "crlf", "tab", "open"],
)
def test_an_indented_fence_runs_its_code_dedented(code):
    """It kept its indentation (the fence and code indented together, as models write inside a list),
    so every such call was an IndentationError. The indentation all its lines share goes; the code's
    own indentation inside stays."""
    body = strip_fence(code).replace("\r\n", "\n")
    assert body.replace("\n\n", "\n") == "x = 6\nif x:\n    print(x * 7)\n"
    compile(body, "<code>", "exec")


def test_indentation_inside_an_indented_fence_stays():
    """Only a margin every line of code has goes: code written at the margin under an indented fence,
    and the indentation of blocks inside, is left as written."""
    at_margin = "    ```python\ndef f():\n    return 1\nprint(f())\n    ```"  # fence indented, code not
    assert strip_fence(at_margin) == "def f():\n    return 1\nprint(f())\n"
    assert strip_fence("```python\ndef f():\n    return 1\n```") == "def f():\n    return 1\n"


@pytest.mark.parametrize(
    "code",
    [
        "``` python\nx = 6\nprint(x * 7)\n```",
        "```python\nx = 6\nprint(x * 7)```",
        "````python\nx = 6\nprint(x * 7)\n````",
        "```python title=\"a.py\"\nx = 6\nprint(x * 7)\n```",
        "```python\nx = 6\nprint(x * 7)\n````",
    ],
    ids=["space_before_tag", "closed_on_the_last_line",
         "four_backticks", "info_string", "longer_close"],
)  # fmt: skip
def test_a_fence_in_the_other_ways_models_write_one_is_stripped(code):
    """These ran with their backticks (a SyntaxError for correct code): an opening fence whose tag
    follows a space, has more to its line, or is longer than three backticks, was no fence; a closing
    fence at the end of the last line of code (`print(x)```) stayed on it. Code never ends in backticks
    outside a string, so there they go; backticks inside the code stay (test_strip_fence)."""
    assert strip_fence(code) == "x = 6\nprint(x * 7)\n"


@pytest.mark.parametrize(
    "code",
    ["```" + " \t" * 32_000 + "a `\nx = 1\n", "```" + " " * 64_000 + "`\n" * 2, "x = 1\n" + "`" * 64_000],
    ids=["blanks_then_a_word", "blanks", "backticks"],
)
def test_a_line_that_is_no_fence_is_read_in_linear_time(code):
    """Hostile fences: a long line that starts like a fence and is none. Each takes about a millisecond
    (a regex that retried the line at each split of its blanks took seconds at 8,000 characters, and
    grows with the square: a guard on the possessive fence regex). The clock is this thread's CPU time;
    the bound is a thousand times the linear cost."""
    t0 = time.thread_time()
    assert strip_fence(code) == code
    assert time.thread_time() - t0 < 1.0


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so \\boxed {5}.", "5"),
        ("\\fbox  {5}", "5"),
        ("\\boxed{3} is wrong, so \\boxed {6}", "6"),
        ("\\boxed {3} is wrong, so \\boxed{6}", "6"),
        ("Answer: 4\n$\\boxed {6}$", "6"),
    ],
)
def test_a_box_with_a_space_before_its_brace_is_an_answer(text, answer):
    """`\\boxed {5}` is LaTeX's `\\boxed{5}` (spaces before an argument are skipped): it was no answer,
    and an earlier box or answer line won over it."""
    assert last_answer(text) == answer
    assert load_env("math").make_episode({"question": "q", "answer": answer}).reward(final(text), []) == 1.0


def test_a_utf8_file_that_starts_with_a_byte_order_mark_is_read(tmp_path):
    """UTF-8 with a byte-order mark (Notepad, PowerShell 5's `Out-File -Encoding utf8`, pandas with
    `utf-8-sig`) is UTF-8 JSON lines: its first line was refused as not JSON ("Unexpected UTF-8 BOM")."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"question": "1+1?", "answer": "2"}\r\n{"question": "q", "answer": "3"}\r\n'
    )
    assert [(r["question"], r["answer"]) for r in load_rows(str(path))] == [("1+1?", "2"), ("q", "3")]
    path.write_bytes(b'\xef\xbb\xbf\n{"question": "q", "answer": "3"}\n')  # and then a blank line
    assert load_rows(str(path))[0]["answer"] == "3"


@pytest.mark.parametrize(
    "text", ["so \\boxed{5}\r\n\r\n**Final Answer:**\r\n", "so \\boxed{5}\nAnswer: $ $\n"]
)
def test_an_answer_line_with_nothing_in_it_leaves_the_box_the_answer(text):
    """An answer line with nothing after its colon is no answer (`\\boxed{5}\\nAnswer:` gives 5), but one
    ended by \\r\\n, or holding only markup, was read as the empty answer, which won over the box."""
    assert last_answer(text) == "5"


@pytest.mark.parametrize(
    "text, boxed",
    [
        (
            "$f(x) = \\boxed{\\left\\{ \\begin{array}{ll} x & x > 0 \\\\ 0 & x \\le 0 \\end{array} \\right.}",
            "\\left\\{ \\begin{array}{ll} x & x > 0 \\\\ 0 & x \\le 0 \\end{array} \\right.",
        ),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{x \\in [0, 1) \\cup \\{2\\}}", "x \\in [0, 1) \\cup \\{2\\}"),
        ("\\boxed{\\{1, 2\\}", None),  # cut off: `\}` prints a brace and the box is still open
        ("\\boxed{a \\\\{b}}", "a \\\\{b}"),  # `\\` is a line break; the brace after it is a group
    ],
)
def test_an_escaped_brace_in_a_box_is_text_not_a_group(text, boxed):
    """`\\{` and `\\}` are braces printed, not LaTeX groups: a piecewise answer (`\\left\\{ … \\right.`)
    counted one brace too many, so its box never closed and the right answer was no answer."""
    assert last_boxed(text) == boxed
