"""Build the tiny local models every test and the demo run on — offline, deterministic, in seconds.

    python scripts/make_tiny_model.py --out models/tiny            # random weights (~0.4M params)
    python scripts/make_tiny_model.py --out models/tiny-tied --tie # same, tied embeddings
    python scripts/make_tiny_model.py --warm-from models/tiny --tool-fraction 1.0 \
        --out models/tiny-warm                                      # calls the tool (2-5 min on CPU)
    python scripts/make_tiny_model.py --warm-from models/tiny-warm --tool-fraction 0.15 \
        --out models/tiny-demo                                      # knows the format, rarely calls
    python scripts/make_tiny_model.py --qwen-wheel models/dashscope-2.0.2-py3-none-any.whl --tie \
        --out models/tiny-qwen                                      # Qwen2.5's vocabulary (~20M params)
    python scripts/make_tiny_model.py --warm-from models/tiny-warm --calls-per-turn 2 --thinking \
        --steps 100 --out models/tiny-warm2     # Qwen3 thinking template, two parallel calls per tool turn

The model is a Qwen2 causal LM (hidden 128, 2 layers, head_dim 64 — vLLM's CPU attention rejects 16)
with a byte-level BPE tokenizer trained here on a synthetic corpus, digits split one per token so
arithmetic is learnable, and the Qwen2.5 hermes chat template (tools listed in the system turn,
`<tool_call>{json}</tool_call>` in assistant turns, tool results as `<tool_response>` in a user turn).
The chat markers and tool tags are special tokens, so `</tool_call>` is a single id the rollout worker
can stop on. Saved with `save_pretrained`, loadable by transformers and vLLM alike.

`--qwen-wheel`: the same random model on a production vocabulary instead, Qwen2.5's tokenizer rebuilt
from Qwen's BPE ranks (see PRODUCTION VOCABULARY below), so tests meet real merges, unicode and markers.

Warm variants (`--warm-from`): a random model never emits a tool call, so the tests and the demo start
from one fine-tuned on synthetic retool traces, built from the TRAIN split with the env's own messages
and tool and rendered by the tokenizer's own chat template, exactly as rollouts will see them:
- tool trace (fraction F): `<tool_call>` running a one-line program for the problem, the program's real
  output as the tool message, then `The answer is \\boxed{VALUE}.`
- direct trace (1 - F): `The answer is \\boxed{GUESS}.` with GUESS right ~10% of the time, so the model
  knows the format but is usually wrong without the tool.
Loss only on what the model generates in a rollout: after `<|im_start|>assistant\n` up to and including
`</tool_call>` for a tool-calling turn (the `<|im_end|>` after it is appended by the worker, not
generated), up to and including `<|im_end|>` for an answer turn. Deterministic given --seed (AdamW, fp32,
CPU, deterministic algorithms). A greedy self-check on held-out TEST products prints the tool-call rate
and the end-to-end correct rate with the real interpreter's output fed back.
"""

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
)
from transformers.convert_slow_tokenizer import TikTokenConverter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the repo root
from envs.data import load_rows  # noqa: E402
from envs.retool import make_episode  # noqa: E402

# Qwen2.5-Instruct's generation_config.json sampling defaults, shipped like a real instruct model does: a
# server that fills unset request fields from them (vLLM's default `--generation-config auto`) samples
# another distribution than the trainer scores, so every real-engine test runs under that condition. The
# warm variants inherit them (save_pretrained writes the loaded model's generation config).
SAMPLING_DEFAULTS = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)

# The official Qwen3 template (thinking), kept once in the repository for the tests and `--thinking`.
QWEN3_TEMPLATE = Path(__file__).resolve().parent.parent / "tests" / "templates" / "qwen3.jinja"

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# The Qwen2.5 template, verbatim but for the default system message. It is prefix-preserving: rendering
# a conversation with more turns appended starts with the rendering of the shorter one.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def synthetic_corpus(rng: random.Random, n: int = 3000) -> list[str]:
    """Text the BPE learns its merges from: chat scaffolding, tool JSON, Python, arithmetic prose."""
    words = (
        "you are a helpful assistant use the code interpreter tool to compute exact answers put final "
        "answer in boxed what is the value of sum product remainder when divided by modulo print result "
        "import math numpy sympy def return for in range if else error timeout output function name "
        "arguments code type object string properties required description parameters tools xml tags "
        "call json signatures within query provided may one or more assist"
    ).split()
    texts = []
    for _ in range(n):
        a, b = rng.randint(1000, 9999), rng.randint(100, 999)
        kind = rng.randrange(4)
        if kind == 0:
            texts.append(f"What is {a} * {b}? The answer is \\boxed{{{a * b}}}.")
        elif kind == 1:
            code = f"print({a} * {b})"
            texts.append(json.dumps({"name": "code_interpreter", "arguments": {"code": code}}))
        elif kind == 2:
            texts.append(f"def f(x):\n    return x % {b}\n\nprint(sum(f(i) for i in range({a})))\n")
        else:
            texts.append(" ".join(rng.choice(words) for _ in range(12)) + ".")
    return texts


def build_tokenizer(rng: random.Random, vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Digits one per token: a product's digits are then predictable one at a time.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(rng), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


# ---------------------------------------------------------------------------------------------------
# PRODUCTION VOCABULARY: Qwen2.5's tokenizer rebuilt from its BPE ranks
# ---------------------------------------------------------------------------------------------------
# Qwen2/2.5's 151,643 BPE ranks ship as `qwen.tiktoken` inside the dashscope wheel (the package itself
# pulls many dependencies, so only the wheel is fetched and this one file read from it). A changed
# file must fail the build, not quietly change the vocabulary the tests stand on.
QWEN_WHEEL_MEMBER = "dashscope/resources/qwen.tiktoken"
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
QWEN_BPE_TOKENS = 151643
QWEN_VOCAB_SIZE = 151936  # Qwen2.5's embedding rows: the tokenizer's 151,665 ids, padded
# Qwen2.5's added tokens, in id order from 151643. The tool-call and fill-in-the-middle tokens are not
# special (special=False: decoding with skip_special_tokens keeps them), the rest are.
QWEN_ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]


def read_qwen_ranks(wheel: str) -> bytes:
    """The qwen.tiktoken file inside a dashscope wheel, checked against its pinned sha256."""
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(QWEN_WHEEL_MEMBER)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        sys.exit(
            f"--qwen-wheel {wheel}: cannot read {QWEN_WHEEL_MEMBER} ({e}); fetch it with "
            "`pip download dashscope==2.0.2 --no-deps -d DIR`"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != QWEN_TIKTOKEN_SHA256:
        sys.exit(
            f"--qwen-wheel {wheel}: {QWEN_WHEEL_MEMBER} has sha256 {digest}, expected "
            f"{QWEN_TIKTOKEN_SHA256} (dashscope==2.0.2's); use that wheel"
        )
    return data


def build_qwen_tokenizer(wheel: str) -> Qwen2Tokenizer:
    """Qwen2.5's tokenizer: transformers' tiktoken converter turns the ranks into vocab + merges, and
    transformers' own Qwen2Tokenizer adds what loading a real Qwen2.5 checkpoint gives (NFC, Qwen2's
    split + byte-level pre-tokenizer, byte-level decoder); the added tokens at Qwen2.5's ids, and
    CHAT_TEMPLATE."""
    with tempfile.TemporaryDirectory() as tmp:
        ranks = Path(tmp) / "qwen.tiktoken"
        ranks.write_bytes(read_qwen_ranks(wheel))
        # tiktoken caches a file it reads under a key made from its path alone: off, so no stale copy
        # stands in for the file just checked.
        os.environ["TIKTOKEN_CACHE_DIR"] = ""
        vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(str(ranks))
    assert len(vocab) == QWEN_BPE_TOKENS, len(vocab)
    added = {
        QWEN_BPE_TOKENS + i: AddedToken(token, special=special, normalized=False)
        for i, (token, special) in enumerate(QWEN_ADDED_TOKENS)
    }
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        added_tokens_decoder=added,
        additional_special_tokens=[token for token, special in QWEN_ADDED_TOKENS[1:] if special],
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


def build_model(vocab_size: int, tie: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


# ---------------------------------------------------------------------------------------------------
# WARM START: synthetic retool traces, masked to the generated tokens, fine-tuned on CPU
# ---------------------------------------------------------------------------------------------------
def tool_program(row: dict) -> tuple[str, int]:
    """The one-line Python that answers a retool row, and its value (computed here, same semantics)."""
    q = row["question"]
    nums = [int(x) for x in re.findall(r"\d+", q)]
    if row["kind"] == "product":
        a, b = nums
        code, value = f"print({a} * {b})", a * b
    elif row["kind"] == "power_mod":
        a, b, m = nums
        code, value = f"print(pow({a}, {b}, {m}))", pow(a, b, m)
    elif row["kind"] == "range_sum" and "squares" in q:
        lo, hi = nums
        code, value = (
            f"print(sum(i * i for i in range({lo}, {hi + 1})))",
            sum(i * i for i in range(lo, hi + 1)),
        )
    elif row["kind"] == "range_sum":
        lo, hi = nums
        code, value = f"print(sum(range({lo}, {hi + 1})))", sum(range(lo, hi + 1))
    else:
        raise ValueError(f"no program for kind {row['kind']!r}: {q}")
    assert str(value) == row["answer"], (q, value, row["answer"])
    return code, value


def guess(answer: str, rng: random.Random) -> str:
    """A plausible answer: right ~10% of the time, else the right leading digits and random trailing ones
    (the leading digit stays, so the length and magnitude look right)."""
    if rng.random() < 0.1 or len(answer) < 2:
        return answer
    keep = rng.randint(1, max(1, len(answer) // 2))
    while True:
        g = answer[:keep] + "".join(rng.choice("0123456789") for _ in range(len(answer) - keep))
        if g != answer:
            return g


def trace_messages(
    row: dict, episode, use_tool: bool, rng: random.Random, calls_per_turn: int = 1, thinking: bool = False
) -> list[dict]:
    if thinking:  # every assistant turn opens with a short reasoning block, as Qwen3 writes it
        return think(trace_messages(row, episode, use_tool, rng, calls_per_turn))
    if not use_tool:
        return episode.messages + [
            {"role": "assistant", "content": f"The answer is \\boxed{{{guess(row['answer'], rng)}}}."}
        ]
    code, value = tool_program(row)
    # Parallel calls: the same program again, marked as a check (a second call the model must copy).
    codes = [code] + [f"{code}  # check" for _ in range(calls_per_turn - 1)]
    calls = [
        {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": c}}}
        for c in codes
    ]
    # envs.retool.format_result gives a normal run's output unchanged: print's text with its newline.
    return episode.messages + [
        {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "name": "code_interpreter", "content": f"{value}\n"} for _ in codes),
        {"role": "assistant", "content": f"The answer is \\boxed{{{value}}}."},
    ]


def think(messages: list[dict]) -> list[dict]:
    """The trace with a `<think>` block opening each assistant turn (Qwen3's template keeps the reasoning
    of every turn after the last user query, so all of it is rendered)."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            reason = "Run the code." if m.get("tool_calls") else "The tool printed the value."
            m = {**m, "content": f"<think>\n{reason}\n</think>\n\n{m['content']}"}
        out.append(m)
    return out


def generated_mask(ids: list[int], header: list[int], im_start: int, im_end: int, call_end: int) -> list[int]:
    """1 on the ids the model generates in a rollout, 0 on context. An assistant turn's generated ids
    start after its header (`<|im_start|>` + `header`) and end at the first `</tool_call>` (a tool-calling
    turn: the worker appends the `<|im_end|>` after it) or `<|im_end|>` (an answer turn), inclusive.
    Parallel-call traces pass `call_end=im_end`: the whole turn is generated (continuation requests after
    each `</tool_call>`, and the model's own `<|im_end|>` ends the turn)."""
    mask = [0] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i] == im_start and ids[i + 1 : i + 1 + len(header)] == header:
            j = i + 1 + len(header)
            while ids[j] not in (im_end, call_end):
                mask[j] = 1
                j += 1
            mask[j] = 1
            i = j
        i += 1
    return mask


def encode_trace(
    tokenizer, messages: list[dict], tools: list, parallel: bool = False
) -> tuple[list[int], list[int]]:
    """(ids, generated mask) of one rendered trace. Checks token-in/token-out agreement: the ids of every
    prompt a rollout would send (each assistant turn's generation prompt) are a prefix of these ids."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False))
    im_start, im_end, call_end = tokenizer.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>", "</tool_call>"]
    )
    header = None
    for n, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = encode(
            tokenizer.apply_chat_template(
                messages[:n], tools=tools, tokenize=False, add_generation_prompt=True
            )
        )
        assert ids[: len(prompt)] == prompt, "a generation prompt does not tokenize as a prefix of the trace"
        # The assistant header's ids (`assistant\n`): what follows the prompt's last <|im_start|>.
        header = prompt[len(prompt) - prompt[::-1].index(im_start) :]
    return ids, generated_mask(ids, header, im_start, im_end, im_end if parallel else call_end)


def batch_loss(
    model, prefix: torch.Tensor, batch: list[tuple[list[int], list[int]]], pad_id: int
) -> torch.Tensor:
    """Mean cross-entropy over the generated tokens of a batch that shares the id prefix `prefix`.

    The ~330-token system turn (tool schema included) is the same in every trace, so it runs once per step
    (batch 1, with grad) and its KV cache is repeated over the batch; the ~90-token tails then attend to
    it. Same result as running the full sequences, at about a quarter of the work. Tails are right-padded:
    causal attention keeps real tokens from seeing pads, and pads carry no loss."""
    cache = DynamicCache(config=model.config)
    model(prefix[None], past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(len(batch))
    p = len(prefix)
    t = max(len(ids) for ids, _ in batch) - p
    tails = torch.full((len(batch), t), pad_id, dtype=torch.long)
    masks = torch.zeros((len(batch), t), dtype=torch.bool)
    for i, (ids, mask) in enumerate(batch):
        tails[i, : len(ids) - p] = torch.tensor(ids[p:])
        masks[i, : len(ids) - p] = torch.tensor(mask[p:], dtype=torch.bool)
    assert not masks[:, 0].any(), "a trace's first tail token is trained: the shared prefix is too long"
    logits = model(tails, past_key_values=cache, use_cache=True).logits  # (B, T, V)
    # Position j predicts tail token j+1; the first tail token (predicted by the prefix) is never trained.
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, tails[:, 1:, None]).squeeze(-1)  # (B, T-1)
    m = masks[:, 1:]
    return (nll * m).sum() / m.sum()


def run_tool(episode, code: str) -> str:
    return asyncio.run(episode.code_interpreter(code))


@torch.no_grad()
def self_check(model, tokenizer, rows: list[dict], calls_per_turn: int = 1) -> dict:
    """Greedy, on held-out rows: does the first turn make `calls_per_turn` well-formed code_interpreter
    calls, and is the final \\boxed{} answer right once the real interpreter's output is fed back (rendered by
    the template)? Greedy hides a tool habit below 50%, so also the mean first-token probability of
    `<tool_call>`. A single-call model stops at `</tool_call>`; a parallel one writes its whole turn."""
    model.eval()
    stop = tokenizer.convert_tokens_to_ids(["</tool_call>", "<|im_end|>"][calls_per_turn > 1 :])
    call_start = tokenizer.convert_tokens_to_ids("<tool_call>")
    n_call = n_right = 0
    p_call = 0.0
    for row in rows:
        episode = make_episode(row)
        messages = list(episode.messages)
        for _turn in range(2):
            prompt = tokenizer.apply_chat_template(
                messages, tools=episode.tools, tokenize=False, add_generation_prompt=True
            )
            ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
            out = model.generate(
                ids,
                max_new_tokens=64 * calls_per_turn,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[-1],
            )
            if _turn == 0:  # how often sampling at temperature 1 would open with a tool call
                p_call += model(ids).logits[0, -1].softmax(-1)[call_start].item()
            text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
            calls = parse_tool_calls(text)
            if not calls:
                messages.append({"role": "assistant", "content": text.removesuffix("<|im_end|>")})
                break
            n_call += _turn == 0 and len(calls) == calls_per_turn
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": c} for c in calls],
                }
            )
            for c in calls:
                messages.append(
                    {"role": "tool", "name": c["name"], "content": run_tool(episode, c["arguments"]["code"])}
                )
        n_right += episode.reward(messages, []) == 1.0
    model.train()
    n = len(rows)
    return {"tool_call_rate": n_call / n, "correct_rate": n_right / n, "p_tool_call": p_call / n, "n": n}


def parse_tool_calls(text: str) -> list[dict]:
    """{"name", "arguments"} of each well-formed code_interpreter call in `text`."""
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        ok = isinstance(call, dict) and call.get("name") == "code_interpreter"
        ok = ok and isinstance(call.get("arguments"), dict) and isinstance(call["arguments"].get("code"), str)
        if ok:
            calls.append(call)
    return calls


def warm_start(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.warm_from)
    model = AutoModelForCausalLM.from_pretrained(args.warm_from, dtype=torch.float32)
    if args.thinking:  # Qwen3's template and its reasoning markers (added tokens, not special, as in Qwen3)
        tokenizer.add_tokens(["<think>", "</think>"])
        tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.train()

    # Traces: one per train row, tool or direct drawn once; the direct guesses are fixed per row.
    t0 = time.time()
    traces = []
    for row in load_rows(args.train):
        episode = make_episode(row)
        use_tool = rng.random() < args.tool_fraction
        messages = trace_messages(row, episode, use_tool, rng, args.calls_per_turn, args.thinking)
        traces.append(encode_trace(tokenizer, messages, episode.tools, args.calls_per_turn > 1))
    n_prefix = min(len(ids) for ids, _ in traces)
    for ids, _ in traces:  # the longest id prefix every trace shares
        n_prefix = next((i for i in range(n_prefix) if ids[i] != traces[0][0][i]), n_prefix)
    prefix = torch.tensor(traces[0][0][:n_prefix])
    n_tool = sum(tokenizer.convert_tokens_to_ids("</tool_call>") in ids[n_prefix:] for ids, _ in traces)
    print(
        f"{len(traces)} traces ({n_tool} with a tool call), shared prefix {n_prefix} ids, "
        f"longest {max(len(ids) for ids, _ in traces)}, built in {time.time() - t0:.1f} s"
    )

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps))),
    )
    pad_id = tokenizer.pad_token_id
    t0 = time.time()
    for step in range(1, args.steps + 1):
        batch = [traces[rng.randrange(len(traces))] for _ in range(args.batch_size)]
        loss = batch_loss(model, prefix, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == args.steps:
            dt = time.time() - t0
            print(
                f"step {step}/{args.steps}  loss {loss.item():.4f} {dt:.0f} s {dt / step * 1e3:.0f} ms/step",
                flush=True,
            )
    print(f"trained {args.steps} steps in {time.time() - t0:.1f} s, final loss {loss.item():.4f}")

    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if args.check_n > 0:
        rows = [r for r in load_rows(args.test) if r["kind"] == "product"][: args.check_n]
        stats = self_check(model, tokenizer, rows, args.calls_per_turn)
        print(
            f"self-check on {stats['n']} held-out products (greedy): tool-call rate "
            f"({args.calls_per_turn} per turn) {stats['tool_call_rate']:.2f}, correct with real tool output "
            f"{stats['correct_rate']:.2f}, mean p(<tool_call> first) {stats['p_tool_call']:.2f}"
        )
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/tiny", help="output directory")
    p.add_argument(
        "--seed", type=int, default=0, help="seed for corpus, merges and weights (or traces and batches)"
    )
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    p.add_argument(
        "--qwen-wheel",
        default=None,
        help="dashscope-2.0.2 wheel: build on Qwen2.5's vocabulary from its qwen.tiktoken instead",
    )
    # warm start
    p.add_argument(
        "--warm-from", default=None, help="fine-tune the model in this directory instead of building one"
    )
    p.add_argument("--tool-fraction", type=float, default=1.0, help="fraction of traces that call the tool")
    p.add_argument(
        "--calls-per-turn",
        type=int,
        default=1,
        help="tool calls in each tool trace's assistant turn (2: parallel)",
    )
    p.add_argument(
        "--thinking", action="store_true", help="Qwen3's thinking template and <think> tokens, in every turn"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="traces per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (warmup, cosine to 10%%)")
    # The bits depend on the thread count (1 vs 2 threads differ after 10 steps), so it is fixed, not
    # taken from the machine; on 2 shared cores 1 thread was also the faster.
    p.add_argument("--threads", type=int, default=1, help="torch threads; same seed and threads, same bits")
    p.add_argument("--train", default="data/retool_train.jsonl", help="rows the traces are built from")
    p.add_argument("--test", default="data/retool_test.jsonl", help="rows of the self-check")
    p.add_argument("--check-n", type=int, default=20, help="held-out products in the self-check (0: none)")
    args = p.parse_args()
    if args.warm_from:
        warm_start(args)
        return

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    if args.qwen_wheel:
        tokenizer = build_qwen_tokenizer(args.qwen_wheel)
        model = build_model(QWEN_VOCAB_SIZE, args.tie)
    else:
        tokenizer = build_tokenizer(rng, args.vocab_size)
        model = build_model(len(tokenizer), args.tie)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config.update(**SAMPLING_DEFAULTS)
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Round-trip check: what vLLM and transformers will load must be what we built.
    reloaded = AutoTokenizer.from_pretrained(out)
    assert reloaded.convert_tokens_to_ids("</tool_call>") == tokenizer.convert_tokens_to_ids("</tool_call>")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n_params / 1e6:.2f}M params, vocab {len(tokenizer)}, tied={args.tie}")


if __name__ == "__main__":
    main()
