"""Build the tiny local models every test and the demo run on — offline, deterministic, in seconds.

    python scripts/make_tiny_model.py --out models/tiny            # random weights (~0.4M params)
    python scripts/make_tiny_model.py --out models/tiny-tied --tie # same, tied embeddings

The model is a Qwen2 causal LM (hidden 128, 2 layers, head_dim 64 — vLLM's CPU attention rejects 16)
with a byte-level BPE tokenizer trained here on a synthetic corpus, digits split one per token so
arithmetic is learnable, and the Qwen2.5 hermes chat template (tools listed in the system turn,
`<tool_call>{json}</tool_call>` in assistant turns, tool results as `<tool_response>` in a user turn).
The chat markers and tool tags are special tokens, so `</tool_call>` is a single id the rollout worker
can stop on. Saved with `save_pretrained`, loadable by transformers and vLLM alike.
"""

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/tiny", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed for corpus, merges and weights")
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--tie", action="store_true", help="tie lm_head to the embeddings")
    args = p.parse_args()

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(rng, args.vocab_size)
    model = build_model(len(tokenizer), args.tie)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
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
