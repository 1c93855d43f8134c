"""The tiny models `make tiny-model` builds: shape, tokenizer, chat template, and that the warm one calls
the tool. Plain transformers on CPU, no vLLM; a few seconds."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.data import load_rows
from envs.retool import make_episode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_model import generated_mask  # noqa: E402


def load(name: str):
    path = REPO / "models" / name
    if not (path / "config.json").exists():
        pytest.fail(f"{path} missing: run `make tiny-model`")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def tool_conversation(episode) -> list[dict]:
    call = {
        "type": "function",
        "function": {"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}},
    }
    return episode.messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "code_interpreter", "content": "42\n"},
        {"role": "assistant", "content": "The answer is \\boxed{42}."},
    ]


def test_tiny_shape_and_untied():
    model, tok = load("tiny")
    assert model.config.head_dim == 64  # vLLM's CPU attention rejects smaller heads
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == len(tok)


def test_tool_tags_are_single_tokens():
    _, tok = load("tiny")
    for tag in ("<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, tag


def test_chat_template_renders_hermes_tool_conversation():
    _, tok = load("tiny")
    episode = make_episode({"question": "What is 6 * 7?", "answer": "42"})
    text = tok.apply_chat_template(tool_conversation(episode), tools=episode.tools, tokenize=False)
    assert "<tools>\n" in text and '"name": "code_interpreter"' in text  # schema in the system turn
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "code_interpreter", '
        '"arguments": {"code": "print(6 * 7)"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n42\n\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is \\boxed{42}.<|im_end|>\n"
    ) in text


def test_generated_mask_stops_at_tool_call_end():
    _, tok = load("tiny")
    episode = make_episode({"question": "What is 6 * 7?", "answer": "42"})
    text = tok.apply_chat_template(tool_conversation(episode), tools=episode.tools, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    im_start, im_end, call_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "</tool_call>"])
    header = tok.encode("assistant\n", add_special_tokens=False)
    mask = generated_mask(ids, header, im_start, im_end, call_end)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    # The <|im_end|> after </tool_call> is appended by the worker, not generated: not trained.
    assert trained == (
        '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
        "The answer is \\boxed{42}.<|im_end|>"
    )


@torch.no_grad()
def test_warm_model_calls_the_tool_on_held_out_problems():
    model, tok = load("tiny-warm")
    stop = tok.convert_tokens_to_ids(["</tool_call>", "<|im_end|>"])
    rows = [r for r in load_rows(str(REPO / "data" / "retool_test.jsonl")) if r["kind"] == "product"][:4]
    for row in rows:
        episode = make_episode(row)
        prompt = tok.apply_chat_template(
            episode.messages, tools=episode.tools, tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=stop, pad_token_id=stop[1])
        text = tok.decode(out[0, ids.shape[1] :])
        m = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, re.DOTALL)
        assert m, f"{row['question']!r}: no tool call in {text!r}"
        call = json.loads(m.group(1))
        assert call["name"] == "code_interpreter" and isinstance(call["arguments"]["code"], str), text
