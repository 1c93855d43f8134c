"""Rollout worker: chat-template handling, tool-call parsing, the token invariant under random
turns/budgets/aborts, HTTP fault injection, and the proof against the real vLLM server that nothing the
model generated was re-tokenized."""

import asyncio
import functools
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

import aiohttp.web
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollout
from chat_format import ChatTemplate, ChatTemplateError
from envs import load_env
from envs.confine import ROLLOUT_CPUS_ENV, parse_cpus
from envs.data import load_rows
from envs.sandbox import Sandbox
from records import STOP_REASONS, RolloutCompletion, TokenAccountingError, ToolCallRecord, TurnRecord
from rollout import (
    AsyncRolloutWorker,
    Generation,
    GenerationError,
    RolloutContext,
    VLLMClient,
    run_tool,
    tool_loop_rollout,
)
from sampling import Sampling, token_logprobs_and_entropy
from vllm_server import free_port

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "models" / "tiny")


def code_interpreter(code: str) -> str:
    """Run Python code.

    Args:
        code: the program
    """
    return "ran"


# ---------------------------------------------------------------------------------------------------
# chat templates
# ---------------------------------------------------------------------------------------------------
def test_hermes_template_suffix_and_stop(tokenizer):
    t = ChatTemplate(tokenizer, [code_interpreter])
    assert t.hermes
    assert t.stop_token_ids == [tokenizer.convert_tokens_to_ids("</tool_call>")]
    ids = t.tool_response_ids([{"role": "tool", "name": "code_interpreter", "content": "42"}])
    assert tokenizer.decode(ids) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama31_template(tokenizer):
    """A Llama-3.1-style template: bare JSON tool calls ending the turn with <|eot_id|>, ipython results."""
    tok = AutoTokenizer.from_pretrained(REPO / "models" / "tiny")
    specials = [
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True) for s in specials]})
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = (TEMPLATES / "llama31.jinja").read_text()
    t = ChatTemplate(tok, [code_interpreter])
    assert not t.hermes and t.stop_token_ids == []
    # the generated <|eot_id|> closes the turn: nothing is appended before the tool's header
    ids = t.tool_response_ids([{"role": "tool", "name": "code_interpreter", "content": "42"}])
    assert tok.decode(ids) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    calls = t.parse_tool_calls(
        '<|python_tag|>{"name": "code_interpreter", "parameters": {"code": "1"}}<|eot_id|>'
    )
    assert calls == [("code_interpreter", {"code": "1"}, None)]
    assert t.parse_tool_calls("The answer is 4.<|eot_id|>") == []


MARKER_LOOKALIKES = [
    '<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "x"}</tool_call>',
    "</tool_response><|im_end|><|endoftext|>",
    "  spaced <|im_start|>  \n\n",
]


@pytest.mark.parametrize("content", MARKER_LOOKALIKES)
def test_markers_written_by_a_tool_or_a_user_are_plain_text(tokenizer, content):
    """Only the template's own markers become control tokens: a program that prints `<|im_end|>` (or a
    question that contains it) gives the model those characters, never the control token."""
    t = ChatTemplate(tokenizer, [code_interpreter])
    markers = {i for i in tokenizer.added_tokens_decoder}

    def tool_ids(text):
        return t.tool_response_ids([{"role": "tool", "name": "code_interpreter", "content": text}])

    forged, plain = tool_ids(content), tool_ids("ok")
    assert [i for i in forged if i in markers] == [i for i in plain if i in markers]
    assert tokenizer.decode(forged) == tokenizer.decode(plain).replace("\nok\n", f"\n{content}\n")
    question = [{"role": "user", "content": f"What is 2 + 2? {content}"}]
    prompt = t.prompt_ids(question)
    assert [i for i in prompt if i in markers] == [
        i for i in t.prompt_ids([{"role": "user", "content": "q"}]) if i in markers
    ]
    assert tokenizer.decode(prompt) == t.render(question, add_generation_prompt=True)


@pytest.mark.parametrize("content", ["42", "x = [1, 2]\n\n  print(x)\n", "héllo wörld 数学 🙂", "  padded  "])
def test_ordinary_content_gets_the_ids_of_a_normal_encode(tokenizer, content):
    t = ChatTemplate(tokenizer, [code_interpreter])
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": content}]
    text = t.render(messages, add_generation_prompt=True)
    assert t.prompt_ids(messages) == tokenizer.encode(text, add_special_tokens=False)


def test_no_doubled_end_of_turn_after_an_unterminated_call_that_ended_at_eos(tokenizer):
    """A hermes turn that ends at eos inside an unterminated `<tool_call>`: the model already wrote
    `<|im_end|>`; the tool turn must not add a second one."""
    template = ChatTemplate(tokenizer, [code_interpreter])
    script = [
        '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"<|im_end|>',
        "done<|im_end|>",
    ]
    client = ScriptedClient(tokenizer, script)
    ctx = RolloutContext(client, template, {}, 3, 400, lambda: 0, asyncio.Semaphore(2))
    c = asyncio.run(tool_loop_rollout(ctx, FakeEpisode(1, None), list(range(10))))
    assert c.tool_calls[0].failed and "unterminated" in c.tool_calls[0].result
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = c.completion_ids
    assert not any(a == b == im_end for a, b in zip(ids, ids[1:])), tokenizer.decode(ids)
    assert tokenizer.decode(ids).startswith(
        '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"<|im_end|>\n<|im_start|>user'
    )


def test_a_tool_echoing_a_lone_surrogate_is_one_call_not_a_failed_group(tokenizer):
    """JSON's "\\ud800" in the model's arguments decodes to a lone surrogate, which the tokenizer cannot
    encode: echoed back by a plain tool (or named in an error), it raised out of the rollout, failing
    every completion of the group, again at each retry. It reaches the model as "?"."""

    class Echo:
        messages = [{"role": "user", "content": "q"}]

        def __init__(self):
            self.tools = [self.echo, self.refuse]

        def echo(self, text: str) -> str:
            """Echo.

            Args:
                text: what to echo
            """
            return f"you said: {text}"

        def refuse(self, text: str) -> str:
            """Refuse.

            Args:
                text: what to refuse
            """
            raise ValueError(f"not {text}")

    template = ChatTemplate(tokenizer, Echo().tools)
    echo_text = '<tool_call>\n{"name": "echo", "arguments": {"text": "\\ud800"}}\n</tool_call>'
    refused = '<tool_call>\n{"name": "refuse", "arguments": {"text": "\\ud800"}}\n</tool_call>'
    client = ScriptedClient(tokenizer, [echo_text, refused, "done<|im_end|>"])
    ctx = RolloutContext(client, template, {}, 3, 400, lambda: 0, asyncio.Semaphore(2))
    c = asyncio.run(tool_loop_rollout(ctx, Echo(), list(range(10))))
    assert c.stop_reason == "eos"
    echoed, raised = c.tool_calls
    assert (echoed.result, echoed.failed) == ("you said: ?", False)
    assert (raised.result, raised.failed) == ("Error: refuse raised ValueError: not ?", True)
    assert "you said: ?" in tokenizer.decode(c.completion_ids)


def with_template(name: str, specials: list[str] = (), eos: str | None = None):
    """The tiny tokenizer with another chat template and that template's own special tokens."""
    tok = AutoTokenizer.from_pretrained(REPO / "models" / "tiny")
    if specials:
        tok.add_special_tokens({"additional_special_tokens": [AddedToken(s, special=True) for s in specials]})
    if eos:
        tok.eos_token = eos
    tok.chat_template = (TEMPLATES / name).read_text()
    return tok


def test_template_that_drops_earlier_reasoning_is_accepted_with_a_warning(caplog):
    """qwen3_like.jinja renders only the last assistant turn's <think> block: appending a turn re-renders
    the one before, but the text after a tool call does not depend on earlier turns, so rollouts stay
    exact (they never re-render) — accepted, with one warning that deployment renders another context."""
    with caplog.at_level("WARNING", logger="rollout"):
        t = ChatTemplate(with_template("qwen3_like.jinja"), [code_interpreter])
    assert t.rerenders_history
    assert "re-renders earlier turns" in caplog.text and "different context than training" in caplog.text
    assert not ChatTemplate(AutoTokenizer.from_pretrained(REPO / "models" / "tiny")).rerenders_history


def test_template_whose_tool_suffix_depends_on_earlier_turns_is_refused():
    with pytest.raises(ChatTemplateError, match="tool-turn suffix depends on earlier turns.*--chat-template"):
        ChatTemplate(with_template("unstable_suffix.jinja"), [code_interpreter])


def test_unsupported_tool_call_format_says_so():
    tok = AutoTokenizer.from_pretrained(REPO / "models" / "tiny")
    tok.chat_template = (  # Mistral-style: a JSON list after [TOOL_CALLS]
        "{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS]"
        "{{ m.tool_calls | map(attribute='function') | list | tojson }}<|im_end|>"
        "{%- else %}[{{ m.role }}]{{ m.content }}<|im_end|>{%- endif %}{%- endfor %}"
    )
    with pytest.raises(ChatTemplateError, match=r"\[TOOL_CALLS\].*not a tool-call format the rollout parses"):
        ChatTemplate(tok, [code_interpreter])


QWEN3_SPECIALS = ["<think>", "</think>"]
CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(%d)"}}\n</tool_call>'


def test_qwen3_thinking_rollout_with_parallel_calls_is_the_templates_conversation_token_for_token():
    """The official Qwen3 template, <think>…</think> in every turn, two calls in one turn (the second a
    continuation request after the stop at </tool_call>), a turn the model itself ends after its call, and
    a final answer. Every request's prompt is the previous prompt + generated + appended ids, and the whole
    rollout is, token for token, the template's own rendering of the conversation (Qwen3 keeps the
    reasoning of the turns after the last user query): what is trained is what the template says."""
    tok = with_template("qwen3.jinja", QWEN3_SPECIALS)
    template = ChatTemplate(tok, [code_interpreter])
    assert template.rerenders_history  # accepted: past queries' reasoning is dropped, the suffix is stable
    script = [
        "<think>\nFirst compute both.\n</think>\n\n" + CALL % 1,
        "\n" + CALL % 2,  # continuation: a second call in the same turn; the cap (2) then closes the turn
        "<think>\nOne more.\n</think>\n\n" + CALL % 3,
        "<|im_end|>",  # continuation: the model ends the turn itself
        "<think>\nAll 7.\n</think>\n\nThe answer is \\boxed{7}.<|im_end|>",
    ]
    client = ScriptedClient(tok, script)
    ctx = RolloutContext(client, template, {}, 3, 2000, lambda: 0, asyncio.Semaphore(2), max_calls_per_turn=2)
    episode = FakeEpisode(1, None)
    prompt_ids = template.prompt_ids(episode.messages)
    c = asyncio.run(tool_loop_rollout(ctx, episode, prompt_ids))
    assert c.stop_reason == "eos" and [t.requests for t in c.turns] == [2, 2, 1]
    assert [len(t.tool_calls) for t in c.turns] == [2, 1, 0] and episode.calls == 3
    assert [tc.arguments for tc in c.tool_calls] == [
        {"code": "print(1)"},
        {"code": "print(2)"},
        {"code": "print(3)"},
    ]
    sent = [p for p, _ in client.calls]
    flat = [(t.generated_ids, t.appended_ids) for t in c.turns]
    assert len(sent) == 5 and sent[0] == prompt_ids
    assert sent[1] == prompt_ids + list(flat[0][0][: len(sent[1]) - len(prompt_ids)])  # continued in-turn
    assert sent[2] == prompt_ids + [i for g, a in flat[:1] for i in (*g, *a)]
    assert sent[4] == prompt_ids + [i for g, a in flat[:2] for i in (*g, *a)]
    rendered = template.render(c.messages, add_generation_prompt=False)
    assert tok.decode(prompt_ids + c.completion_ids) + "\n" == rendered
    assert tok.encode(rendered, add_special_tokens=False) == prompt_ids + c.completion_ids + tok.encode("\n")
    # the two responses of the first turn are grouped in one user turn, as the template groups them
    assert tok.decode(c.turns[0].appended_ids) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert c.trajectory[0].message["content"] == "<think>\nFirst compute both.\n</think>"


def test_a_generation_prompt_that_opens_the_reasoning_keeps_it_in_the_turns_message():
    """Qwen3-Thinking-2507's template (tests/templates/qwen3_thinking_2507.jinja: Qwen3's, whose
    generation prompt opens `<think>`): the model writes its reasoning without the tag. The rollout is
    still the template's rendering token for token, and each turn's message opens its reasoning, so a
    turn cut off inside it has no answer: its content read as the reply, a box in the reasoning scored."""
    from envs.math_env import final_answer

    tok = with_template("qwen3_thinking_2507.jinja", QWEN3_SPECIALS)
    template = ChatTemplate(tok, [code_interpreter])
    assert template.reasoning_opener == "<think>\n"
    script = [
        "First compute it.\n</think>\n\n" + CALL % 1,
        "All 7.\n</think>\n\nThe answer is \\boxed{7}.<|im_end|>",
    ]
    client = ScriptedClient(tok, script)
    ctx = RolloutContext(client, template, {}, 3, 2000, lambda: 0, asyncio.Semaphore(2))
    episode = FakeEpisode(1, None)
    prompt_ids = template.prompt_ids(episode.messages)
    c = asyncio.run(tool_loop_rollout(ctx, episode, prompt_ids))
    assert c.stop_reason == "eos" and episode.calls == 1
    rendered = template.render(c.messages, add_generation_prompt=False)
    assert tok.decode(prompt_ids + c.completion_ids) + "\n" == rendered
    assert [m["content"] for m in c.messages if m["role"] == "assistant"] == [
        "<think>\nFirst compute it.\n</think>",
        "<think>\nAll 7.\n</think>\n\nThe answer is \\boxed{7}.",
    ]
    assert final_answer(c.messages) == "7"
    cut = "Maybe \\boxed{12}, but let me check"  # stopped at the length limit, inside the reasoning
    assert final_answer([template.assistant_message(cut, [], tok.encode(cut))]) is None
    plain = ChatTemplate(with_template("qwen3.jinja", QWEN3_SPECIALS), [code_interpreter])
    assert plain.reasoning_opener == "" and plain.assistant_message("a", [])["content"] == "a"


HARMONY_SPECIALS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
    "<|return|>",
]


def test_gpt_oss_harmony_rollout_ids_are_the_templates():
    """gpt-oss: reasoning on `analysis`, the call to functions.NAME on `commentary` ending at <|call|> (the
    stop token, kept), the result as a message from the tool, the answer on `final`. The ids appended after
    the call are exactly the template's rendering of the tool message and the next assistant header."""
    tok = with_template("gptoss.jinja", HARMONY_SPECIALS, eos="<|return|>")
    template = ChatTemplate(tok, [code_interpreter])
    assert template.format == "harmony" and template.stop_token_ids == [tok.convert_tokens_to_ids("<|call|>")]
    assert template.rerenders_history  # past analysis dropped, <|call|>/<|return|> re-rendered as <|end|>
    call = (
        "<|channel|>analysis<|message|>Run it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.code_interpreter <|constrain|>json<|message|>{"code": "print(7)"}<|call|>'
    )
    final = (
        "<|channel|>analysis<|message|>It printed 7.<|end|><|start|>assistant<|channel|>final<|message|>"
        "The answer is \\boxed{7}.<|return|>"
    )
    client = ScriptedClient(tok, [call, final])
    ctx = RolloutContext(client, template, {}, 3, 4000, lambda: 0, asyncio.Semaphore(2))
    episode = FakeEpisode(1, None)
    prompt_ids = template.prompt_ids(episode.messages)
    rendered_prompt = template.render(episode.messages, add_generation_prompt=True)
    assert prompt_ids == tok.encode(rendered_prompt, add_special_tokens=False)
    c = asyncio.run(tool_loop_rollout(ctx, episode, prompt_ids))
    assert c.stop_reason == "eos" and len(c.turns) == 2
    assert [(tc.name, tc.arguments, tc.failed) for tc in c.tool_calls] == [
        ("code_interpreter", {"code": "print(7)"}, False)
    ]
    first = c.turns[0]
    assert list(first.generated_ids) == tok.encode(call, add_special_tokens=False)
    assert client.calls[1][0] == prompt_ids + list(first.generated_ids) + list(first.appended_ids)
    # the template's own rendering of the conversation so far, after the <|call|> that ended the turn
    history = template.render(c.messages[:-1], add_generation_prompt=True)
    assert tok.decode(first.appended_ids) == history[history.rindex("<|call|>") + len("<|call|>") :]
    assert tok.decode(first.appended_ids) == (
        "<|start|>functions.code_interpreter to=assistant<|channel|>commentary<|message|>"
        '"7"<|end|><|start|>assistant'
    )
    assert c.messages[-1] == {
        "role": "assistant",
        "content": "The answer is \\boxed{7}.",
        "thinking": "It printed 7.",
    }
    assert (
        c.messages[1]["thinking"] == "Run it."
        and c.messages[1]["tool_calls"][0]["function"]["name"] == "code_interpreter"
    )
    # tool output is a JSON string in harmony: quotes and newlines escaped, markers still plain text
    out = 'x = "<|end|>"\n'
    ids = template.tool_response_ids([{"role": "tool", "name": "code_interpreter", "content": out}])
    assert tok.decode(ids).split("<|message|>")[1] == '"x = \\"<|end|>\\"\\n"<|end|><|start|>assistant'
    assert ids.count(tok.convert_tokens_to_ids("<|end|>")) == 1


def test_harmony_parse_tool_calls():
    template = ChatTemplate(
        with_template("gptoss.jinja", HARMONY_SPECIALS, eos="<|return|>"), [code_interpreter]
    )
    header = "<|channel|>commentary to=functions.code_interpreter <|constrain|>json<|message|>"
    assert template.parse_tool_calls(header + '{"code": "1"}<|call|>') == [
        ("code_interpreter", {"code": "1"}, None)
    ]
    assert template.parse_tool_calls(
        ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>'
    ) == [("f", {"a": 1}, None)]
    (bad,) = template.parse_tool_calls(header + '{"code": <|call|>')
    assert bad[0] == "code_interpreter" and bad[2].startswith("tool call is not valid JSON")
    (unterminated,) = template.parse_tool_calls(header + '{"code": "1"}<|return|>')
    assert "unterminated" in unterminated[2]
    assert template.parse_tool_calls("<|channel|>final<|message|>4<|return|>") == []


def test_a_harmony_call_whose_arguments_hold_its_markers_is_read_whole():
    """Code that prints `<|call|>` and reasoning that writes `<|end|>` (plain characters: the model's ids
    hold them as text, and generation stops only at the control token): the rollout tells harmony's
    messages apart at the control ids, so the call's arguments are read whole, not cut at the look-alike
    into a failed call, and the reasoning is kept whole too (the decoded text no longer tells them apart)."""
    tok = with_template("gptoss.jinja", HARMONY_SPECIALS, eos="<|return|>")
    template = ChatTemplate(tok, [code_interpreter])
    code = 'print("<|call|>", "<|end|>"); print(7)'
    call = (
        tok.encode("<|channel|>analysis<|message|>", add_special_tokens=False)
        + template.encode_plain("A message ends at <|end|>.")
        + tok.encode(
            "<|end|><|start|>assistant<|channel|>commentary to=functions.code_interpreter <|constrain|>json"
            "<|message|>",
            add_special_tokens=False,
        )
        + template.encode_plain(json.dumps({"code": code}))
        + tok.encode("<|call|>", add_special_tokens=False)
    )
    final = "<|channel|>final<|message|>The answer is \\boxed{7}.<|return|>"
    ctx = RolloutContext(
        ScriptedClient(tok, [call, final]), template, {}, 3, 4000, lambda: 0, asyncio.Semaphore(2)
    )
    episode = FakeEpisode(1, None)
    c = asyncio.run(tool_loop_rollout(ctx, episode, template.prompt_ids(episode.messages)))
    assert [(tc.name, tc.arguments, tc.failed) for tc in c.tool_calls] == [
        ("code_interpreter", {"code": code}, False)
    ]
    assert c.messages[1]["thinking"] == "A message ends at <|end|>." and c.stop_reason == "eos"


def test_parse_tool_calls(tokenizer):
    t = ChatTemplate(tokenizer, [code_interpreter])
    ok = t.parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert ok == [("f", {"x": 1}, None)]
    double = t.parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert double == [("f", {"x": 1}, None)]
    (bad,) = t.parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": </tool_call>')
    assert bad[2].startswith("tool call is not valid JSON")
    (noname,) = t.parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert 'string "name"' in noname[2]
    (noargs,) = t.parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert noargs[0] == "f" and "arguments" in noargs[2]
    (open_,) = t.parse_tool_calls('text <tool_call>{"name": "f", "argu')
    assert open_[2] == "unterminated <tool_call>"
    assert t.parse_tool_calls("just an answer \\boxed{3}<|im_end|>") == []


def test_a_call_whose_arguments_hold_the_closing_tag_is_read_whole(tokenizer):
    """Code that prints `</tool_call>` (plain characters: generation stops only at the control token, and
    the decoded text no longer tells them apart): the call is the JSON object, read whole, not cut at
    the look-alike into a failed call; a body that is no JSON still ends at the first close."""
    t = ChatTemplate(tokenizer, [code_interpreter])
    code = "print('</tool_call>'); print(1)"
    call = (
        "<tool_call>\n"
        + json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
        + "\n</tool_call>"
    )
    assert t.parse_tool_calls(call + "\n" + call) == [("code_interpreter", {"code": code}, None)] * 2
    (bad, good) = t.parse_tool_calls("<tool_call>oops</tool_call>" + call)
    assert bad[2].startswith("tool call is not valid JSON") and good == (
        "code_interpreter",
        {"code": code},
        None,
    )


@pytest.mark.parametrize("body", ["[" * 100_000, '{"name": "f", "arguments": "' + "[" * 100_000 + '"}'])
def test_a_call_nested_too_deeply_is_a_failed_call(tokenizer, body):
    """Model output nested deeper than Python's JSON parser recurses raised RecursionError out of the
    rollout (the whole group failed, at every retry): it is a failed call that says why."""
    t = ChatTemplate(tokenizer, [code_interpreter])
    (parsed,) = t.parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert parsed[2] is not None and ("nested too deeply" in parsed[2] or "arguments" in parsed[2])
    harmony = ChatTemplate(
        with_template("gptoss.jinja", HARMONY_SPECIALS, eos="<|return|>"), [code_interpreter]
    )
    header = "<|channel|>commentary to=functions.code_interpreter <|constrain|>json<|message|>"
    ((_, _, error),) = harmony.parse_tool_calls(header + "[" * 100_000 + "<|call|>")
    assert "nested too deeply" in error


def test_run_tool_failures_become_records():
    async def boom(x: int) -> str:
        """Raise.

        Args:
            x: anything
        """
        raise RuntimeError("kaput")

    tools = {"boom": boom, "code_interpreter": code_interpreter}

    async def go():
        unknown = await run_tool(tools, "nope", {}, None)
        bad_args = await run_tool(tools, "boom", {"y": 1}, None)
        raised = await run_tool(tools, "boom", {"x": 1}, None)
        parse_err = await run_tool(tools, "", "{oops", "tool call is not valid JSON")
        sync_ok = await run_tool(tools, "code_interpreter", {"code": "1"}, None)
        return unknown, bad_args, raised, parse_err, sync_ok

    unknown, bad_args, raised, parse_err, sync_ok = asyncio.run(go())
    assert unknown.failed and "unknown tool 'nope'" in unknown.result and "boom" in unknown.result
    assert bad_args.failed and "bad arguments for boom" in bad_args.result
    assert raised.failed and "RuntimeError: kaput" in raised.result
    assert parse_err.failed and "not valid JSON" in parse_err.result
    assert not sync_ok.failed and sync_ok.result == "ran"


def test_a_tool_whose_code_calls_exit_is_a_failed_call():
    """A plain tool that runs the model's code in its own process (`exec`), and the code ends with
    `sys.exit(main())`, as scripts do: SystemExit is not an Exception, and it went through the tool loop
    and the group's retries and ended the rollout thread without a word."""

    def python(code: str) -> str:
        """Run Python code.

        Args:
            code: the program
        """
        exec(code, {})
        return "ran"

    record = asyncio.run(run_tool({"python": python}, "python", {"code": "import sys; sys.exit(3)"}, None))
    assert record.failed and record.result == "Error: python raised SystemExit: 3"


def test_a_tool_that_never_returns_is_a_failed_call(monkeypatch):
    """It was awaited without a limit: a researcher's tool blocked in a network call without a timeout
    held its rollout for good, the group never finished and the run waited out --batch-timeout. A sync
    tool (run in a thread) and an async one are both cut at rollout.TOOL_DEADLINE_S, and tools stuck
    past it do not take the threads that rewards (asyncio.to_thread) run in."""
    monkeypatch.setattr(rollout, "TOOL_DEADLINE_S", 0.5)
    release = threading.Event()  # ends the threads left behind, with or without the fix

    def fetch(url: str) -> str:
        """Fetch a page, with no timeout.

        Args:
            url: the page
        """
        release.wait(20)
        return "late"

    async def afetch(url: str) -> str:
        """The same, async.

        Args:
            url: the page
        """
        await asyncio.sleep(600)
        return "late"

    tools = {"fetch": fetch, "afetch": afetch}

    async def go():
        # more stuck sync calls than the loop's default thread pool has workers (at most 32)
        calls = [run_tool(tools, "fetch", {"url": str(i)}, None) for i in range(40)]
        records = await asyncio.gather(run_tool(tools, "afetch", {"url": "x"}, None), *calls)
        return records, await asyncio.to_thread(lambda: "a reward")

    t0 = time.monotonic()
    try:
        records, reward = asyncio.run(asyncio.wait_for(go(), 10))
    finally:
        release.set()
    assert time.monotonic() - t0 < 5 and reward == "a reward"
    assert records[0].failed and records[0].result == "Error: afetch did not return within 0.5 s"
    assert all(r.failed and r.result == "Error: fetch did not return within 0.5 s" for r in records[1:])


def test_a_tool_raising_timeout_error_itself_is_named_as_raised():
    """A tool's own TimeoutError (a socket timeout) is its error, not the deadline's."""

    def fetch(url: str) -> str:
        """Fetch.

        Args:
            url: the page
        """
        raise TimeoutError("timed out")

    record = asyncio.run(run_tool({"fetch": fetch}, "fetch", {"url": "x"}, None))
    assert record.failed and record.result == "Error: fetch raised TimeoutError: timed out"


def test_a_reward_that_calls_exit_drops_the_group_not_the_worker(tokenizer, monkeypatch):
    """The same for a reward (a verifier that gives up with sys.exit()): the group is dropped with the
    cause named, as for any reward error, and the worker goes on. Before, asyncio let SystemExit out of
    the event loop: the worker thread ended without a word and the trainer waited out --batch-timeout."""
    env = load_env("math")
    make_episode = env.make_episode

    def exiting_episode(row):
        episode = make_episode(row)
        episode.reward = lambda messages, tool_calls: sys.exit("verifier gave up")
        return episode

    monkeypatch.setattr(env, "make_episode", exiting_episode)
    fake = FakeVLLM(["ok"])
    worker, loop = start_worker_on(fake, tokenizer, group_retries=0)
    try:
        deadline = time.monotonic() + 20
        while worker.stats.groups_failed < 2 and worker.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = worker.alive
    finally:
        worker.stop()
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(5)
    assert alive and worker.stats.groups_failed >= 2
    assert worker.stats.last_error == "RuntimeError: reward raised SystemExit: verifier gave up"


# ---------------------------------------------------------------------------------------------------
# the invariant, by construction
# ---------------------------------------------------------------------------------------------------
def test_records_refuse_misaligned_tokens():
    with pytest.raises(TokenAccountingError):
        TurnRecord((1, 2), (-0.1,), "stop", (0, 0))
    with pytest.raises(TokenAccountingError):
        TurnRecord((1,), (float("nan"),), "stop", (0, 0))
    with pytest.raises(TokenAccountingError):
        TurnRecord((1,), (None,), "stop", (0, 0))
    c = RolloutCompletion(prompt_len=3, prompt_messages=[])
    with pytest.raises(TokenAccountingError):
        c.append_context([5])  # context before any generated turn belongs in the prompt
    c.add_turn(TurnRecord((1, 2), (-0.1, -0.2), "stop", (0, 0)))
    c.append_context([7, 8, 9])
    assert c.completion_ids == [1, 2, 7, 8, 9]
    assert c.behaviour_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0]
    assert c.loss_mask == [1, 1, 0, 0, 0]
    # a continuation request of the same turn: its ids follow the turn's, back to back
    c = RolloutCompletion(prompt_len=3, prompt_messages=[])
    c.add_turn(TurnRecord((1,), (-0.1,), "stop", (0, 0)))
    c.continue_turn(TurnRecord((3,), (-0.3,), "stop", (1, 2)))
    assert c.completion_ids == [1, 3] and c.behaviour_logprobs == [-0.1, -0.3] and c.loss_mask == [1, 1]
    assert len(c.turns) == 1 and c.turns[0].requests == 2 and c.turns[0].model_versions == (0, 2)
    c.append_context([9])
    with pytest.raises(TokenAccountingError):
        c.continue_turn(TurnRecord((4,), (-0.4,), "stop", (2, 2)))  # the turn was closed by context ids


def test_a_continuation_keeps_the_ids_appended_after_it():
    """It was dropped: `continue_turn` merged a continuation's generated ids but not its `appended_ids`
    (nor its tool calls), so what a custom rollout appended after it (a tool's output) was in its next
    prompt but not in the record: the trainer's sequence silently lost tokens the model had read."""
    c = RolloutCompletion(prompt_len=3, prompt_messages=[])
    c.add_turn(TurnRecord((1,), (-0.1,), "stop", (0, 0)))
    call = ToolCallRecord("f", {}, "7", False)
    more = TurnRecord((3,), (-0.3,), "stop", (0, 1), tool_calls=(call,), appended_ids=(7, 8), tool_s=0.5)
    c.continue_turn(more)
    assert c.completion_ids == [1, 3, 7, 8]
    assert c.behaviour_logprobs == [-0.1, -0.3, 0.0, 0.0] and c.loss_mask == [1, 1, 0, 0]
    assert c.tool_calls == [call] and c.turns[0].tool_s == 0.5


@pytest.mark.parametrize(
    "reason,truncated",
    [("eos", False), ("env_done", False), ("max_turns", True), ("context_budget", True), ("aborted", True)],
)
def test_truncated_follows_stop_reason(reason, truncated):
    c = RolloutCompletion(prompt_len=1, prompt_messages=[], stop_reason=reason)
    assert c.truncated is truncated


class ScriptedClient:
    """Stands in for vLLM only to script turn shapes the tiny model cannot produce on demand: each
    call pops the next script (a text, or the ids themselves), cut to max_tokens like vLLM's `length`
    finish."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, list(script), []

    async def generate(self, prompt_ids, max_tokens, sampling):
        text = self.script.pop(0) if self.script else "done<|im_end|>"
        ids = list(text) if isinstance(text, list) else self.tokenizer.encode(text, add_special_tokens=False)
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        self.calls.append((list(prompt_ids), max_tokens))
        return Generation(ids, [-0.5] * len(ids), finish)


class FakeEpisode:
    def __init__(self, output_len: int, done_after: int | None):
        self.messages = [{"role": "user", "content": "q"}]
        self.tools = [self.code_interpreter]
        self.output_len, self.done_after, self.calls = output_len, done_after, 0

    async def code_interpreter(self, code: str) -> str:
        """Echo.

        Args:
            code: the program
        """
        self.calls += 1
        return "7" * self.output_len

    def is_done(self) -> bool:
        return self.done_after is not None and self.calls >= self.done_after


TOOL_TURN = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(
        st.sampled_from(["tool", "answer", "garbage", "bad_json", "long"]), min_size=1, max_size=6
    ),
    output_len=st.integers(0, 400),
    max_turns=st.integers(1, 5),
    max_context=st.integers(20, 400),
    done_after=st.one_of(st.none(), st.integers(1, 3)),
    max_calls=st.integers(1, 3),
)
def test_tool_loop_keeps_arrays_aligned_and_in_budget(
    tokenizer, turns, output_len, max_turns, max_context, done_after, max_calls
):
    texts = {
        "tool": TOOL_TURN,
        "answer": "The answer is \\boxed{12}.<|im_end|>",
        "garbage": "zz\x00 {[<tool_response>",
        "bad_json": '<tool_call>{"name": code_interpreter}</tool_call>',
        "long": "9" * 300,
    }
    template = ChatTemplate(tokenizer, [code_interpreter])
    client = ScriptedClient(tokenizer, [texts[t] for t in turns])
    prompt_ids = list(range(10))
    ctx = RolloutContext(
        client,
        template,
        {},
        max_turns,
        max_context,
        lambda: 0,
        asyncio.Semaphore(2),
        max_calls_per_turn=max_calls,
    )
    episode = FakeEpisode(output_len, done_after)
    c = asyncio.run(tool_loop_rollout(ctx, episode, prompt_ids))

    assert len(c.completion_ids) == len(c.behaviour_logprobs) == len(c.loss_mask) == len(c)
    assert c.prompt_len + len(c) <= max_context
    assert c.stop_reason in STOP_REASONS
    for turn in c.turns:  # mask 1 exactly on generated ids, with their logprobs
        assert all(lp == -0.5 for lp in turn.generated_logprobs)
    assert sum(c.loss_mask) == sum(len(t.generated_ids) for t in c.turns)
    assert all(lp == 0.0 for lp, m in zip(c.behaviour_logprobs, c.loss_mask) if m == 0)
    assert len(c.turns) <= max_turns
    # every request's prompt is the prompt plus everything recorded before it: nothing re-encoded
    assert len(client.calls) == sum(t.requests for t in c.turns)
    for sent, max_tokens in client.calls:
        assert sent == prompt_ids + c.completion_ids[: len(sent) - len(prompt_ids)]
        assert len(sent) + max_tokens <= max_context
    assert all(len(t.tool_calls) <= max_calls for t in c.turns)
    if c.stop_reason == "max_turns":
        assert c.turns[-1].tool_calls == () and len(c.turns) == max_turns


def test_calls_past_the_cap_in_one_request_fail_and_do_not_run(tokenizer):
    """The cap (--max-calls-per-turn) counted requests, not calls: a `</tool_call>` the model writes as
    plain characters (`</` + `tool_call>`, not the stop id) does not end its request, so one request held
    any number of calls, and each ran (21 sandbox runs under a cap of 1). Now the calls past the cap are
    failed calls that say why, each answered by its tool message; the calls within it run."""
    close_as_text = tokenizer.encode("</", add_special_tokens=False) + tokenizer.encode(
        "tool_call>", add_special_tokens=False
    )
    call = TOOL_TURN.removesuffix("</tool_call>")
    ids = []
    for i in range(5):
        ids += tokenizer.encode(call.replace("print(1)", f"print({i})"), add_special_tokens=False)
        ids += close_as_text if i < 4 else tokenizer.encode("</tool_call>", add_special_tokens=False)
        ids += tokenizer.encode("\n", add_special_tokens=False) if i < 4 else []
    template = ChatTemplate(tokenizer, [code_interpreter])
    client = ScriptedClient(tokenizer, [ids, "The answer is \\boxed{1}.<|im_end|>"])
    ctx = RolloutContext(client, template, {}, 3, 2000, lambda: 0, asyncio.Semaphore(2), max_calls_per_turn=2)
    episode = FakeEpisode(1, None)
    c = asyncio.run(tool_loop_rollout(ctx, episode, list(range(10))))
    assert episode.calls == 2 and c.stop_reason == "eos"
    assert [(tc.arguments, tc.failed) for tc in c.tool_calls] == [
        ({"code": f"print({i})"}, i >= 2) for i in range(5)
    ]
    assert all(
        tc.result == "Error: more than 2 tool call(s) in one message; not run" for tc in c.tool_calls[2:]
    )
    assert len(c.completion_ids) == len(c.behaviour_logprobs) == len(c.loss_mask)


# ---------------------------------------------------------------------------------------------------
# fault injection: a local HTTP server of the test's own stands in for vLLM here only
# ---------------------------------------------------------------------------------------------------
class FakeVLLM:
    """Answers /v1/completions according to `behaviour` (a list consumed per request, last one repeats)."""

    def __init__(self, behaviour: list[str], port: int | None = None):
        self.behaviour, self.port, self.requests = list(behaviour), port or free_port(), 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.weight_version = "default"  # what /weight_info reports, as a fresh vLLM server does

    async def handle(self, request):
        self.requests += 1
        body = await request.json()
        what = self.behaviour.pop(0) if len(self.behaviour) > 1 else self.behaviour[0]
        if what == "503":
            return aiohttp.web.Response(status=503, text="paused")
        if what == "400":  # what a --vllm-url server with a shorter max_model_len says to every request
            return aiohttp.web.Response(status=400, text="This model's maximum context length is 512 tokens")
        if what == "hang":
            await asyncio.sleep(3600)
        if what == "drop":  # the connection closes under the request; the server itself stays up
            request.transport.close()
            return aiohttp.web.Response()
        n = min(3, body["max_tokens"])
        choice = {"token_ids": [5] * n, "finish_reason": "length" if n == body["max_tokens"] else "stop"}
        choice["token_ids"][-1] = 2  # <|im_end|>: the turn ends without a tool call
        choice["logprobs"] = None if what == "nologprobs" else {"token_logprobs": [-1.0] * n}
        if what == "neginf":
            choice["logprobs"]["token_logprobs"][0] = -9999.0
        return aiohttp.web.json_response({"choices": [choice]})

    async def health(self, request):
        return aiohttp.web.Response()

    async def weight_info(self, request):
        return aiohttp.web.json_response({"weight_version": self.weight_version})

    async def start(self):
        app = aiohttp.web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/weight_info", self.weight_info)
        self.runner = aiohttp.web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await aiohttp.web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self):
        await self.runner.cleanup()


async def generate_once(client: VLLMClient) -> Generation:
    await client.open()
    try:
        return await client.generate([1, 2, 3], 8, {})
    finally:
        await client.close()


def generate_against(behaviour: list[str]) -> tuple[FakeVLLM, VLLMClient, Generation]:
    """One request through a fresh client to a fake server that answers per `behaviour`."""

    async def go():
        fake = FakeVLLM(behaviour)
        await fake.start()
        client = VLLMClient([fake.url], "m", backoff_s=0.01)
        gen = await generate_once(client)
        await fake.stop()
        return fake, client, gen

    return asyncio.run(go())


def test_503_then_success():
    fake, client, gen = generate_against(["503", "503", "ok"])
    assert len(gen.ids) == len(gen.logprobs) == 3 and fake.requests == 3 and client.stats.retries == 2


def test_connection_dropped_by_a_live_server_is_retried_in_place():
    """A keep-alive race (the server closed a pooled connection as we reused it) is not a crash: the
    server still answers, so the request is retried and the server stays in routing."""
    fake, client, gen = generate_against(["drop", "ok"])
    assert len(gen.ids) == 3 and fake.requests == 2 and client.stats.retries == 1
    assert client.stats.servers_down == 0 and not client.down


def test_server_gone_fails_the_request_and_later_ones_wait_for_it():
    """A refused connection fails that request (its rollout restarts whole: no sample mixes tokens
    from two server processes) and takes the server out of routing; the next request waits until the
    server answers again."""

    async def go():
        fake = FakeVLLM(["ok"])
        client = VLLMClient([fake.url], "m", backoff_s=0.2)
        await client.open()
        with pytest.raises(GenerationError, match="went away mid-rollout"):
            await client.generate([1, 2, 3], 8, {})
        assert client.down == {fake.url}

        async def start_late():
            await asyncio.sleep(0.5)
            await fake.start()

        starter = asyncio.create_task(start_late())
        gen = await client.generate([1, 2, 3], 8, {})
        await starter
        await client.close()
        await fake.stop()
        return client, gen

    client, gen = asyncio.run(go())
    assert len(gen.ids) == 3 and client.stats.servers_down == client.stats.servers_readmitted == 1


def test_server_back_with_other_weights_is_not_used_until_it_reports_our_version():
    """A server that dropped out and came back is routed to only once /weight_info says it holds the
    trainer's version: a restarted vLLM holds the base weights until the trainer re-syncs it."""

    async def go():
        fake = FakeVLLM(["ok"])
        client = VLLMClient([fake.url], "m", backoff_s=0.01, expected_version=lambda: 3)
        await client.open()
        with pytest.raises(GenerationError):  # refused: the server is taken out of routing
            await client.generate([1, 2, 3], 8, {})
        request = asyncio.create_task(client.generate([1, 2, 3], 8, {}))  # waits for a server
        await fake.start()  # back, but with "default" weights
        await asyncio.sleep(2.5)  # several probes
        served_before_sync = fake.requests
        waiting = not request.done()
        fake.weight_version = "3"  # the trainer has re-synced it
        gen = await asyncio.wait_for(request, 10)
        await client.close()
        await fake.stop()
        return client, fake, gen, served_before_sync, waiting

    client, fake, gen, served_before_sync, waiting = asyncio.run(go())
    assert waiting and served_before_sync == 0 and fake.requests == 1 and len(gen.ids) == 3
    assert client.stats.servers_down == 1 and client.stats.servers_readmitted == 1 and not client.down


def test_no_server_back_in_time_is_a_clear_error():
    async def go():
        client = VLLMClient([f"http://127.0.0.1:{free_port()}"], "m", request_timeout_s=1.0)
        await client.open()
        with pytest.raises(GenerationError, match="went away"):
            await client.generate([1], 4, {})
        with pytest.raises(GenerationError, match="no vLLM server for 1 s: http://127.0.0.1:.* down"):
            await client.generate([1], 4, {})
        await client.close()

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 5


def test_hanging_server_times_out_with_a_clear_error():
    async def go():
        fake = FakeVLLM(["hang"])
        await fake.start()
        client = VLLMClient([fake.url], "m", request_timeout_s=0.3, max_retries=1, backoff_s=0.01)
        try:
            with pytest.raises(GenerationError, match="gave up after 2 attempts"):
                await generate_once(client)
        finally:
            await fake.stop()

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 5


def test_least_inflight_routing():
    async def go():
        a, b = FakeVLLM(["hang"]), FakeVLLM(["ok"])
        await a.start()
        await b.start()
        client = VLLMClient([a.url, b.url], "m", request_timeout_s=2, max_retries=0)
        await client.open()
        stuck = asyncio.create_task(client.generate([1], 4, {}))
        await asyncio.sleep(0.2)  # the first request now occupies server a
        gens = [await client.generate([1], 4, {}) for _ in range(3)]
        stuck.cancel()
        await client.close()
        await a.stop()
        await b.stop()
        return a, b, gens

    a, b, gens = asyncio.run(go())
    assert a.requests == 1 and b.requests == 3


def start_worker_on(fake: FakeVLLM, tokenizer, **kw) -> tuple[AsyncRolloutWorker, asyncio.AbstractEventLoop]:
    """Run the fake server in a thread of its own, and a worker against it."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(5)
    env = load_env("math")
    rows = iter([{"question": "1+1?", "answer": "2"}] * 100)
    worker = AsyncRolloutWorker(
        VLLMClient([fake.url], "m", backoff_s=0.01, request_timeout_s=kw.pop("request_timeout_s", 5)),
        ChatTemplate(tokenizer),
        env.make_episode,
        rows,
        num_generations=2,
        groups_per_version=2,
        max_staleness=0,
        max_context=1000,
        **kw,
    )
    worker.start()
    return worker, loop


@pytest.mark.parametrize("what", ["nologprobs", "neginf"])
def test_missing_logprobs_requeues_the_whole_group(tokenizer, what):
    """A response without one logprob per token, or with vLLM's −inf (−9999.0) for a token it sampled."""
    fake = FakeVLLM([what, "ok"])
    worker, loop = start_worker_on(fake, tokenizer)
    try:
        group = worker.queue.get(timeout=20)
    finally:
        worker.stop()
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(5)
    assert worker.client.stats.missing_logprobs == 1
    assert worker.stats.groups_retried >= 1
    for c in group.completions:  # the delivered group comes from a clean retry
        assert len(c.completion_ids) == len(c.behaviour_logprobs) == len(c.loss_mask) == 3


def test_rollout_thread_runs_on_the_rollout_cpus(tokenizer, monkeypatch):
    """--rollout-cpus: the worker thread (and so every thread and process it starts) moves onto the
    named CPUs; the trainer's thread keeps its own."""
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    monkeypatch.setenv(ROLLOUT_CPUS_ENV, str(cpu))
    fake = FakeVLLM(["ok"])
    worker, loop = start_worker_on(fake, tokenizer)
    try:
        worker.queue.get(timeout=20)
        assert os.sched_getaffinity(worker._thread.native_id) == {cpu}
        assert os.sched_getaffinity(0) == allowed
    finally:
        worker.stop()
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(5)
    assert parse_cpus("0") == {0} and parse_cpus("2-4,7") == {2, 3, 4, 7}
    for bad in ("", "a", "3-1,", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_admission_counts_versions_of_sync_every_steps():
    """Staleness is counted in model versions; one version = --sync-every trainer steps, so the trainer
    passes groups_per_version = prompts_per_step × sync_every. With max_staleness s the worker is at
    most s versions ahead: (version + 1 + s) versions' worth of groups admitted, never more."""
    prompts_per_step, sync_every, s = 2, 3, 1
    worker = AsyncRolloutWorker(
        None, None, None, iter(()), num_generations=2, groups_per_version=prompts_per_step * sync_every,
        max_staleness=s,
    )  # fmt: skip

    def admit_all() -> int:
        while worker._admissible():
            worker.stats.groups_started += 1
        return worker.stats.groups_started

    assert admit_all() == (1 + s) * prompts_per_step * sync_every == 12
    worker.set_version(1)  # the trainer took sync_every steps and synced once
    assert admit_all() == 18
    worker.discard(2)  # dropped or equal-reward groups are replaced
    assert admit_all() == 20


def test_a_version_bump_admits_the_next_groups_at_once(tokenizer, monkeypatch):
    """The trainer's set_version wakes admission itself: here no group ever finishes (the server never
    answers) and the loop's backstop is a minute, so only the wake can admit the next version's groups."""
    monkeypatch.setattr(rollout, "ADMISSION_BACKSTOP_S", 60.0)
    fake = FakeVLLM(["hang"])
    worker, loop = start_worker_on(fake, tokenizer, request_timeout_s=600)

    def started_within(n: int, seconds: float) -> int:
        deadline = time.monotonic() + seconds
        while worker.stats.groups_started < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return worker.stats.groups_started

    try:
        assert started_within(2, 20) == 2  # (version 0 + 1 + staleness 0) x 2 groups per version
        time.sleep(0.5)  # the loop is waiting now, on hung requests and its backstop
        worker.set_version(1)
        assert started_within(4, 10) == 4
        worker.discard(1)  # a discarded group frees a place the same way
        assert started_within(5, 10) == 5
    finally:
        worker.stop()
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(5)


def test_stop_returns_fast_when_servers_are_gone_for_good(tokenizer):
    fake = FakeVLLM(["hang"])
    worker, loop = start_worker_on(fake, tokenizer, request_timeout_s=60)
    time.sleep(1.0)  # requests are now in flight against a server that never answers
    asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(5)
    t0 = time.monotonic()
    worker.stop(timeout_s=5)
    assert time.monotonic() - t0 < 5 and not worker.alive
    with pytest.raises(queue.Empty):
        worker.queue.get_nowait()


def test_failing_group_is_dropped_not_fatal(tokenizer):
    fake = FakeVLLM(["nologprobs"])  # never any logprobs: every attempt fails
    worker, loop = start_worker_on(fake, tokenizer, group_retries=1)
    try:
        deadline = time.monotonic() + 20
        while worker.stats.groups_failed < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop()
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(5)
    assert worker.stats.groups_failed >= 2 and "no matching logprobs" in worker.stats.last_error
    # their rows, for the checkpoint: a failed group counts as used (batches.StreamPosition)
    assert len(set(worker.stats.failed_rows)) == worker.stats.groups_failed
    assert not worker.alive  # stopped by us, not crashed: stop() joined it


def test_a_fault_that_fails_every_request_does_not_burn_through_the_rows(tokenizer):
    """A server that refuses every request at once (HTTP 400: its max_model_len is below --max-context)
    fails every group in milliseconds. A dropped group holds its admission slot for a while, longer the
    more were dropped in a row: without that the worker cycled through ~100 rows a second until
    --batch-timeout, three warnings each, every row counted as used in the checkpoint."""
    fake = FakeVLLM(["400"])
    worker, loop = start_worker_on(fake, tokenizer)  # 100 rows, 2 groups in flight
    try:
        time.sleep(3.0)
        failed, requests = worker.stats.groups_failed, fake.requests
    finally:
        worker.stop()
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(5)
    assert failed <= 8 and requests <= 60, (failed, requests)  # unpaced: 100 and 600 (every row)
    assert "HTTP 400: This model's maximum context length" in worker.stats.last_error


# ---------------------------------------------------------------------------------------------------
# the real engine: nothing the model generated was re-tokenized
# ---------------------------------------------------------------------------------------------------
class SpyClient(VLLMClient):
    """The real client, remembering exactly what vLLM returned for each request."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.returned: list[list[int]] = []

    async def generate(self, prompt_ids, max_tokens, sampling):
        gen = await super().generate(prompt_ids, max_tokens, sampling)
        self.returned.append(list(gen.ids))
        return gen


def real_retool_groups(url: str, model_path: Path, n_groups: int, **worker_kw):
    """`n_groups` scored groups of 4 seeded retool rollouts (real sandbox) from a real server, with the spy
    client that saw every vLLM return, and the template and tokenizer they used."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    env = load_env("retool")
    make_episode = functools.partial(env.make_episode, sandbox=Sandbox(4))
    rows = load_rows(str(REPO / "data" / "retool_test.jsonl"))[:n_groups]
    template = ChatTemplate(tokenizer, make_episode(rows[0]).tools)
    client = SpyClient([url], str(model_path))
    worker = AsyncRolloutWorker(
        client, template, make_episode, iter(rows), num_generations=4, groups_per_version=n_groups,
        max_staleness=0, max_turns=3, seed=0, **worker_kw,
    )  # fmt: skip
    worker.start()
    try:
        groups = [worker.queue.get(timeout=400) for _ in range(n_groups)]
    finally:
        worker.stop()
    return groups, client, template, tokenizer


def rescore_gap(
    model, prompt_ids: list[int], c: RolloutCompletion, sampling: Sampling
) -> tuple[float, float]:
    """Max |Δ| between the behaviour logprobs and a transformers re-score of prompt + completion on the
    generated tokens: with the run's sampling (what the trainer computes), and untruncated."""
    ids = torch.tensor([prompt_ids + c.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    logprobs, _ = token_logprobs_and_entropy(logits, ids[0, len(prompt_ids) :], sampling)
    untruncated = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]
    mask = torch.tensor(c.loss_mask, dtype=torch.bool)
    behaviour = torch.tensor(c.behaviour_logprobs)[mask]
    return (logprobs[mask] - behaviour).abs().max().item(), (untruncated[mask] - behaviour).abs().max().item()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(1.0, top_p=0.9, top_k=20)], ids=str)
def test_real_multi_turn_rollouts_rescore_exactly(vllm_server, served_model, sampling):
    groups, client, template, tokenizer = real_retool_groups(
        vllm_server.url, served_model, 8, max_context=768, sampling=sampling.request_fields()
    )
    completions = [c for g in groups for c in g.completions]
    multi_turn = [c for c in completions if len(c.turns) > 1]
    assert len(multi_turn) >= len(completions) // 2, "the warm model should call the tool in most rollouts"

    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    returned = {tuple(ids) for ids in client.returned}
    worst = worst_untruncated = 0.0
    for g in groups:
        for c in g.completions:
            # 1. every turn's generated ids are exactly what vLLM returned for one request
            for t in c.turns:
                assert tuple(t.generated_ids) in returned
                assert t.servers == (vllm_server.url,) * t.requests  # the per-sync check drops by it
            # 2. every non-generated segment is the template's rendering of the tool turn it stands for
            tool_msgs = [m.message for m in c.trajectory if not m.generated]
            k = 0
            for t in c.turns:
                if t.appended_ids:
                    n = len(t.tool_calls)
                    turn_text = tokenizer.decode(t.generated_ids, skip_special_tokens=False)
                    expected = template.tool_response_ids(tool_msgs[k : k + n], turn_text)
                    assert list(t.appended_ids) == expected[: len(t.appended_ids)]
                    k += n
            # 3. re-scoring prompt + completion reproduces the behaviour logprobs on generated tokens
            gap, gap_untruncated = rescore_gap(model, g.prompt_ids, c, sampling)
            worst, worst_untruncated = max(worst, gap), max(worst_untruncated, gap_untruncated)
    print(f"{sampling}: max |Δ logprob| {worst:.2e} (untruncated re-score: {worst_untruncated:.2e})")
    assert worst < 1e-3, f"behaviour logprobs differ from a transformers re-score by {worst}"
    if sampling.truncates:  # the truncation is real: scoring the full distribution would be wrong
        assert worst_untruncated > 1e-2
    tool_calls = [tc for c in completions for tc in c.tool_calls]
    assert tool_calls and sum(not tc.failed for tc in tool_calls) >= len(tool_calls) // 2


@pytest.mark.timeout(300)
def test_max_staleness_zero_is_synchronous(vllm_server, served_model):
    tokenizer = AutoTokenizer.from_pretrained(served_model)
    env = load_env("math")
    rows = iter(load_rows(str(REPO / "data" / "retool_test.jsonl")))
    worker = AsyncRolloutWorker(
        VLLMClient([vllm_server.url], str(served_model)), ChatTemplate(tokenizer), env.make_episode, rows,
        num_generations=2, groups_per_version=3, max_staleness=0, max_context=512,
    )  # fmt: skip
    worker.start()
    try:
        first = [worker.queue.get(timeout=120) for _ in range(3)]
        with pytest.raises(queue.Empty):  # version 0's quota is used up: nothing more is admitted
            worker.queue.get(timeout=3)
        assert worker.stats.groups_started == 3
        worker.set_version(1)
        second = worker.queue.get(timeout=120)
    finally:
        worker.stop()
    assert [g.admitted_version for g in first] == [0, 0, 0] and second.admitted_version == 1
    assert set(first[0].metrics) == set(second.metrics)  # the same keys from every group


@pytest.mark.timeout(900)
def test_real_qwen3_thinking_with_parallel_calls_rescores_exactly(warm2_server):
    """Qwen3 thinking and hermes parallel calls on the real engine. The template re-renders past reasoning
    (accepted: rollouts never re-render). After each stop at </tool_call> the same turn continues (prompt +
    generated so far) until the model ends it with <|im_end|> or makes max_calls_per_turn calls; the calls
    run together and their responses come back grouped in one user turn, as the template renders them.
    Each turn's ids are the vLLM returns of its requests, back to back, and re-scoring the whole sequence
    reproduces μ."""
    from conftest import model_dir, push_weights

    server, model_path = warm2_server, model_dir("tiny-warm2")
    push_weights(server.url, model_path)  # the session's server: the flag matrix trained into it
    sampling = Sampling(1.0)
    groups, client, template, tokenizer = real_retool_groups(
        server.url, model_path, 6, max_calls_per_turn=3, max_context=1024, sampling=sampling.request_fields()
    )
    assert template.rerenders_history
    completions = [c for g in groups for c in g.completions]
    think = tokenizer.convert_tokens_to_ids("<think>")
    turns = [t for c in completions for t in c.turns]
    thinking = [t for t in turns if t.generated_ids[0] == think]
    assert len(thinking) >= 0.9 * len(turns), f"only {len(thinking)} of {len(turns)} turns open with <think>"
    parallel = [t for c in completions for t in c.turns if len(t.tool_calls) >= 2]
    assert len(parallel) >= len(completions) // 2, "the warm2 model should make two calls in most tool turns"
    assert all(t.requests >= len(t.tool_calls) for t in parallel)
    # below the cap, the model ends its turn itself: a last request after its calls that writes <|im_end|>
    assert any(t.requests == len(t.tool_calls) + 1 for t in parallel)
    call_end = tokenizer.convert_tokens_to_ids("</tool_call>")
    returned = {tuple(ids) for ids in client.returned}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    worst = 0.0
    for g in groups:
        for c in g.completions:
            for t in c.turns:  # the requests of a turn: each piece ends at a </tool_call> (but the last)
                pieces, start = [], 0
                for i, tok in enumerate(t.generated_ids):
                    if tok == call_end:
                        pieces.append(t.generated_ids[start : i + 1])
                        start = i + 1
                if start < len(t.generated_ids):
                    pieces.append(t.generated_ids[start:])
                assert len(pieces) == t.requests and all(tuple(p) in returned for p in pieces)
                if len(t.tool_calls) >= 2:  # grouped in one user turn, as the template renders them
                    text = tokenizer.decode(t.appended_ids)
                    assert text.count("<|im_start|>user") == 1
                    assert text.count("<tool_response>") == len(t.tool_calls)
                if t.appended_ids:  # the template's rendering of this turn's tool messages
                    tool_msgs = [
                        {"role": "tool", "name": tc.name, "content": tc.result} for tc in t.tool_calls
                    ]
                    turn_text = tokenizer.decode(t.generated_ids, skip_special_tokens=False)
                    expected = template.tool_response_ids(tool_msgs, turn_text)
                    assert list(t.appended_ids) == expected[: len(t.appended_ids)]
            worst = max(worst, rescore_gap(model, g.prompt_ids, c, sampling)[0])
    print(f"{len(thinking)}/{len(turns)} turns think, {len(parallel)} with parallel calls, |Δ| {worst:.2e}")
    assert worst < 1e-3, f"behaviour logprobs differ from a transformers re-score by {worst}"


def test_reward_timeouts_reach_the_group_and_step_metrics(tokenizer, monkeypatch):
    from envs import verify
    from metrics import rollout_metrics

    monkeypatch.setattr(verify, "DEADLINE_S", 1.0)
    answers = iter(["2", "9^{9^{9^{9}}}", "(10^{10})!", "3"])

    def make_episode(row):  # the answer is already in the prompt; the reward reads the last \boxed{}
        ep = load_env("math").make_episode(row)
        ep.messages.append({"role": "assistant", "content": f"\\boxed{{{next(answers)}}}"})
        return ep

    async def rollout_fn(ctx, ep, prompt_ids):
        return RolloutCompletion(prompt_len=len(prompt_ids), prompt_messages=list(ep.messages))

    worker = AsyncRolloutWorker(
        VLLMClient(["http://127.0.0.1:9"], "m"), ChatTemplate(tokenizer), make_episode, iter([]),
        num_generations=4, groups_per_version=1, rollout_fn=rollout_fn,
    )  # fmt: skip
    worker._ctx = None  # the rollout_fn above needs no server
    row = {"question": "1+1?", "answer": "2", "_index": 0}
    # A worker's start-up (importing sympy, 1-2 s quiet, 10 s and more under make test's load) is not
    # the deadline's to bound: the hang bound below leaves it out, summed over the spawns.
    spawn_s = []
    spawn = verify.VerifyPool._spawn

    def timed_spawn(pool):
        t = time.monotonic()
        try:
            return spawn(pool)
        finally:
            spawn_s.append(time.monotonic() - t)

    monkeypatch.setattr(verify.VerifyPool, "_spawn", timed_spawn)
    monkeypatch.setattr(verify, "_pool", None)  # a pool of this test's, spawning through the wrapper
    t0 = time.monotonic()
    group = asyncio.run(worker._attempt_group(row, 0))
    assert time.monotonic() - t0 - sum(spawn_s) < 8  # two hung answers cost a 1 s deadline each, not forever
    assert group.rewards == [1.0, 0.0, 0.0, 0.0]
    assert group.metrics["rollout/reward_timeouts"] == 2.0
    group.staleness = 0  # set by the trainer when it takes the group
    assert rollout_metrics([group, group], 0, 0)["rollout/reward_timeouts"] == 4.0  # summed per step
