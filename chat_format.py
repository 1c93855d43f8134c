"""The chat format: messages → token ids and model output → tool calls, through the model's own chat
template (no aiohttp, no server). The prompt is rendered once; each tool turn's ids are the template's
rendering of just that suffix; only the template's own markers become control ids (a tool that prints
`<|im_end|>` gives the model those characters); tool calls are parsed from the decoded text of the
model's ids (hermes `<tool_call>` JSON as Qwen2.5 and Qwen3 write it, gpt-oss harmony: its messages told
apart at the ids' control tokens), never re-encoded.
"""

import json
import logging
import re
from collections.abc import Callable, Sequence

import jinja2
from tokenizers import Tokenizer
from transformers.utils import get_json_schema

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    pass


_CALL_SENTINEL = "\ue002"  # in a probe call's arguments: marks where the template wrote the call


def _probe_call(name: str = "probe_tool") -> dict:
    return {"type": "function", "function": {"name": name, "arguments": {"x": _CALL_SENTINEL}}}


class ChatTemplate:
    """What the rollout loop needs from a tokenizer's chat template, checked once at start-up.

    Three tool-call formats are understood, selected once from the template's own markers:
    - hermes (Qwen2.5, Qwen3): `<tool_call>{json}</tool_call>`; generation stops at the closing tag, and
      with `max_calls_per_turn > 1` the turn is continued so the model can open another call;
    - harmony (gpt-oss): a message to `functions.NAME` on the commentary channel, ended by `<|call|>`
      (generation stops there; one call per assistant message, as the format has it);
    - Llama-3.1: a bare JSON object ending the turn with `<|eot_id|>`/`<|eom_id|>`, optionally after
      `<|python_tag|>`.
    Without tools a template need not write calls at all: if it cannot, the format is "none" and
    nothing is parsed as a call. With tools, one that cannot is refused.

    The loop never re-renders earlier turns: what the model generated is what it sees next and what is
    trained. The only text taken from the template after the prompt is the tool-turn suffix (the rest of
    the calling turn, the tool messages, the next assistant header), so that suffix must not depend on
    earlier turns (checked; refused otherwise). A template that re-renders earlier turns (Qwen3 and
    gpt-oss drop past reasoning) is accepted with a warning: training is exact, but a deployment that
    re-renders the history shows the model another context than the one it was trained in.
    """

    def __init__(self, tokenizer, tools: list[Callable] | None = None):
        self.tokenizer = tokenizer
        self.tools = [get_json_schema(t) for t in tools or []] or None
        template = tokenizer.chat_template or ""
        if "<tool_call>" in template:
            self.format, self._call_end = "hermes", "</tool_call>"
        elif "<|call|>" in template:
            self.format, self._call_end = "harmony", "<|call|>"
        else:
            self.format, self._call_end = "llama3", tokenizer.eos_token or ""
        self.hermes = self.format == "hermes"
        # Every added token (chat markers, tool tags) by its text: these are the template's own, and the
        # only place they become control ids is where the template writes them.
        added = {a.content: i for i, a in tokenizer.added_tokens_decoder.items()}
        self._plain = _without_added_tokens(tokenizer.backend_tokenizer)
        self._marker_ids = added
        self._marker_texts = {i: text for text, i in added.items()}
        self._markers = re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")")
        # The id that ends a tool call: generation stops there and includes it (Llama-3.1's is eos).
        self.stop_token_ids: list[int] = []
        try:
            if self.format != "llama3":
                end_id = tokenizer.convert_tokens_to_ids(self._call_end)
                if end_id is None or end_id == tokenizer.unk_token_id:
                    raise ChatTemplateError(f"tool calls end with {self._call_end!r}: not one token")
                self.stop_token_ids = [end_id]
            self._check_call_format()
            self._check_tool_suffix_is_stable()
        except ChatTemplateError as e:
            if self.tools:
                raise
            # A tool-free env (`--env math`) never needs a call written, and many math and base models'
            # templates cannot write one: then nothing the model writes is read as a call, and its turn
            # ends the episode (a template that can write calls keeps answering them "unknown tool").
            logger.info("no tools and the chat template has no usable tool-call format (%s)", e)
            self.format, self.hermes, self._call_end, self.stop_token_ids = "none", False, "", []
        # Checked with or without tools: without it every prompt and tool turn ends after `<|im_end|>\n`
        # (no assistant header) and the model generates there, with nothing to say something is wrong.
        probe = self._probe_conversation()[:2]
        if self.render(probe, add_generation_prompt=True) == self.render(probe, add_generation_prompt=False):
            raise ChatTemplateError(
                "the chat template writes nothing for add_generation_prompt, so prompts and tool turns would "
                "end without the assistant header. Pass --chat-template PATH with one that writes it"
            )
        rerendered = self._rerendered_turn()
        if rerendered:
            logger.warning(
                "the chat template re-renders earlier turns (appending a %r turn changes the text before "
                "it, e.g. past reasoning is dropped). Training stays exact: rollouts keep the ids the model "
                "generated and the template's tool-turn suffix, which does not depend on earlier turns. "
                "But a deployment that re-renders the history with this template shows the model a "
                "different context than training did.",
                rerendered,
            )
        self.rerenders_history = rerendered is not None
        # A generation prompt that opens the reasoning (Qwen3-Thinking-2507, QwQ): the model's text starts
        # inside `<think>`, which is the prompt's. A turn cut off there has no `<think>` of its own, and
        # a reward reading its content took the reasoning for the reply (a box in it scored).
        prompt = self.render(self._probe_conversation()[:2], add_generation_prompt=True).rstrip(" ")
        self.reasoning_opener = (
            prompt[prompt.rindex("<think>") :] if prompt.rstrip().endswith("<think>") else ""
        )
        self.prompt_ids(self._probe_conversation()[:2])  # a template that rewrites content fails here

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (jinja2.TemplateError, ValueError) as e:  # ValueError: a tokenizer with no template at all
            raise ChatTemplateError(
                f"the chat template does not render ({e}). Pass --chat-template PATH with one that does"
            ) from e

    def encode_plain(self, text: str) -> list[int]:
        """`text` as plain text: normalizer, pre-tokenizer and BPE, but no added tokens — a tool that
        prints `<|im_end|>` gives the model those characters, never the control token. A batch of one:
        `encode_batch` runs in Rust without the GIL, which the trainer's thread needs meanwhile."""
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def _encode_render(self, with_sentinels: str, rendered: str, contents: list[str]) -> list[int]:
        """Ids of `rendered` (a template rendering of messages whose contents are `contents`), where only
        the template's own text can hold control tokens: `with_sentinels` is the same rendering with
        each content replaced by a sentinel. Splitting it at the markers is what the tokenizer does
        (added tokens first, then BPE per piece), so ordinary content gets the ids of a normal encode."""
        pieces = self._markers.split(with_sentinels)  # odd indices: markers written by the template
        # Some templates trim content (Llama-3.1's user turns) or write it as a JSON string (gpt-oss's
        # tool results).
        for transform in (str, str.strip, lambda c: json.dumps(c, ensure_ascii=False)[1:-1]):
            # One pass: a content holding another's sentinel characters is never substituted again.
            written = [transform(c) for c in contents]
            texts = [
                p if k % 2 else _SENTINELS.sub(lambda m, w=written: w[int(m.group(1))], p)
                for k, p in enumerate(pieces)
            ]
            if "".join(texts) == rendered:
                break
        else:
            raise ChatTemplateError(
                "the chat template rewrites message content (not verbatim, trimmed or JSON-quoted), so tool "
                "output cannot be kept apart from its control tokens; pass --chat-template with one that "
                "does not"
            )
        ids: list[int] = []
        for k, text in enumerate(texts):
            ids += [self._marker_ids[text]] if k % 2 else self.encode_plain(text) if text else []
        return ids

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        marked, contents = _with_sentinels(messages)
        return self._encode_render(
            self.render(marked, add_generation_prompt=True),
            self.render(messages, add_generation_prompt=True),
            contents,
        )

    def _probe_conversation(self) -> list[dict]:
        conv = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [_probe_call()]},
            {"role": "tool", "name": "probe_tool", "content": "r"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "b"},
        ]
        # Without a call format the template may reject a tool turn, which such a rollout never has.
        return conv[:2] + conv[4:] if self.format == "none" else conv

    def _check_call_format(self) -> None:
        """The template writes a tool call the way the selected parser reads it, or we say it is not a
        format the rollout supports (rather than fail later on something else)."""
        conv = self._probe_conversation()
        try:
            prompt = self.render(conv[:2], add_generation_prompt=True)
            text = self.render(conv[:3], add_generation_prompt=False)
        except Exception as e:  # the template rejected our probe: say so rather than guess
            raise ChatTemplateError(f"chat template failed on a tool conversation: {e}") from e
        call = text[len(prompt) :] if text.startswith(prompt) else text
        at = call.find(_CALL_SENTINEL)
        supported = {
            "hermes": "<tool_call>" in call[:at],
            "harmony": "to=functions.probe_tool" in call[:at],
            "llama3": call.replace("<|python_tag|>", "").lstrip().startswith('{"name": "probe_tool"'),
        }[self.format]
        if at < 0 or not supported or not self._call_end or self._call_end not in call[at:]:
            raise ChatTemplateError(
                f"the chat template writes a tool call as {call!r}: not a tool-call format the rollout "
                "parses (hermes <tool_call>…</tool_call> as Qwen2.5/Qwen3, gpt-oss harmony, Llama-3.1 JSON). "
                "Pass --chat-template PATH with one of these."
            )

    def _tool_suffix(self, history: list[dict], tool_messages: list[dict]) -> tuple[str, str]:
        """(text with sentinel contents, text) the template writes after the last tool call of an
        assistant turn that follows `history` and calls the tools of `tool_messages`: the rest of that
        turn, the tool messages and the next assistant header."""
        names = [m.get("name") or "probe_tool" for m in tool_messages] or ["probe_tool"]
        call = {"role": "assistant", "content": "", "tool_calls": [_probe_call(n) for n in names]}
        marked, _ = _with_sentinels(tool_messages)
        with_sentinels = self.render(history + [call] + marked, add_generation_prompt=True)
        rendered = self.render(history + [call] + tool_messages, add_generation_prompt=True)
        cut = with_sentinels.find(self._call_end, with_sentinels.rfind(_CALL_SENTINEL)) + len(self._call_end)
        if rendered[:cut] != with_sentinels[:cut]:
            raise ChatTemplateError("the chat template renders a tool call differently after each result")
        return with_sentinels[cut:], rendered[cut:]

    def _check_tool_suffix_is_stable(self) -> None:
        """The one text the loop takes from the template after the prompt is the tool-turn suffix, rendered
        once without the rollout's history: it must be the same after any earlier turns."""
        conv = self._probe_conversation()
        tool = [{"role": "tool", "name": "probe_tool", "content": "r"}]
        first, _ = self._tool_suffix(conv[:2], tool)
        for history, after in ((conv[:4], "a second call"), (conv[:6], "a call after a new user turn")):
            other, _ = self._tool_suffix(history, tool)
            if other != first:
                raise ChatTemplateError(
                    "the chat template's tool-turn suffix depends on earlier turns: after a first call the "
                    f"template appends {first!r}, after {after} {other!r}. Token-in/token-out rollouts "
                    "append the model's ids and one rendered suffix, so they cannot follow it. Pass "
                    "--chat-template PATH with a template whose tool turn does not depend on the history."
                )

    def _rerendered_turn(self) -> str | None:
        """The role of the first turn whose appending re-renders the text before it, or None when every
        rendering is a prefix of the rendering with more turns (Qwen3 and gpt-oss drop past reasoning)."""
        conv = self._probe_conversation()
        previous = ""
        for n in range(2, len(conv) + 1):
            text = self.render(conv[:n], add_generation_prompt=False)
            if not text.startswith(previous):
                return conv[n - 1]["role"]
            previous = text
        return None

    def tool_response_ids(self, tool_messages: list[dict], turn_text: str = "") -> list[int]:
        """Ids appended after a tool-calling turn: the rest of the assistant turn, the tool messages and
        the next assistant header — rendered as a suffix, never re-encoding model output. Tool output is
        plain text (see `encode_plain`). `turn_text`, the decoded turn, tells whether the model already
        wrote the marker the rest of the turn starts with (it ended at eos after its calls, or inside an
        unterminated one): then that marker is not appended twice."""
        marked, contents = _with_sentinels(tool_messages)
        with_sentinels, rendered = self._tool_suffix(self._probe_conversation()[:2], tool_messages)
        first = self._markers.match(with_sentinels)
        if first and turn_text.endswith(first.group()):
            with_sentinels, rendered = with_sentinels[first.end() :], rendered[first.end() :]
        return self._encode_render(with_sentinels, rendered, contents)

    def _split_at_markers(self, text: str, ids: Sequence[int] | None) -> list[str]:
        """The turn's text split at its control tokens, the markers at odd indices (`self._markers.split`).
        From the turn's generated `ids` where given (the rollout): a marker's characters the model wrote
        as plain text (code printing `<|call|>`) stay text, which the decoded text no longer tells apart."""
        if ids is None:
            return self._markers.split(text)
        pieces, start, decode = [], 0, self.tokenizer.backend_tokenizer.decode
        for k, i in enumerate(ids):
            if i in self._marker_texts:
                pieces += [
                    decode(ids[start:k], skip_special_tokens=False) if k > start else "",
                    self._marker_texts[i],
                ]
                start = k + 1
        return pieces + [decode(ids[start:], skip_special_tokens=False)]

    def parse_tool_calls(
        self, text: str, ids: Sequence[int] | None = None
    ) -> list[tuple[str, dict | str, str | None]]:
        """(name, arguments, error) per call in a turn's text; error is None for a well-formed call.
        `ids`, the turn's generated ids, tell harmony's control tokens from their characters
        (`_split_at_markers`)."""
        if self.format == "none":  # no tools and a template that cannot write a call: nothing is one
            return []
        if self.format == "harmony":
            return [
                _parse_arguments(recipient.removeprefix("functions."), body)
                if end == "<|call|>"
                else (recipient.removeprefix("functions."), body, "unterminated call (no <|call|>)")
                for _, recipient, body, end in _harmony_messages(self._split_at_markers(text, ids))
                if recipient
            ]
        if self.hermes:
            return [
                _parse_call(body.strip())
                if body is not None
                else ("", text[opener + len("<tool_call>") :], "unterminated <tool_call>")
                for opener, body in _hermes_calls(text)
            ]
        stripped = text.replace("<|python_tag|>", "").strip()
        for eos in (self.tokenizer.eos_token, "<|eot_id|>", "<|eom_id|>"):
            if eos and stripped.endswith(eos):
                stripped = stripped[: -len(eos)].strip()
        return [_parse_call(stripped)] if stripped.startswith("{") else []

    def assistant_message(self, text: str, calls: list, ids: Sequence[int] | None = None) -> dict:
        """The chat message of a generated turn (what rewards and a later re-render see): hermes keeps the
        text before the first call (reasoning included, opened by `reasoning_opener` where the generation
        prompt opened it), harmony the final channel's text with the
        analysis channel as `thinking` (its messages told apart at the control tokens of `ids`, as in
        `parse_tool_calls`), Llama-3.1 the text of a turn without a call."""
        if self.format == "harmony":
            messages = _harmony_messages(self._split_at_markers(text, ids))
            final = [body for channel, recipient, body, _ in messages if channel == "final" and not recipient]
            analysis = [body for channel, _, body, _ in messages if channel == "analysis"]
            message = {"role": "assistant", "content": "" if calls else "".join(final)}
            if analysis:
                message["thinking"] = "\n".join(analysis)
        else:
            if self.hermes:  # the text before the first call (`_hermes_calls`: not a tag its reasoning names)
                content = text[: next((opener for opener, _ in _hermes_calls(text)), len(text))]
            else:
                content = "" if calls else text
            for tok in (self.tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
                if tok and content.endswith(tok):
                    content = content[: -len(tok)]
            content = self.reasoning_opener + content  # the reasoning is its, however the turn ended
            message = {"role": "assistant", "content": content.strip() if calls else content}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": n, "arguments": a if isinstance(a, dict) else {}}}
                for n, a, _ in calls
            ]
        return message


_SENTINEL = "\ue000{}\ue001"  # private-use characters: no template or tokenizer treats them specially
_SENTINELS = re.compile("\ue000([0-9]+)\ue001")


def _without_added_tokens(backend: Tokenizer) -> Tokenizer:
    """A copy of the tokenizer that knows no added tokens, so nothing in a text becomes a control id."""
    spec = json.loads(backend.to_str())
    spec.update(added_tokens=[], truncation=None, padding=None)
    return Tokenizer.from_str(json.dumps(spec))


def _with_sentinels(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """The messages with each string content replaced by a numbered sentinel, and the contents."""
    marked, contents = [], []
    for m in messages:
        if isinstance(m.get("content"), str) and m["content"]:
            contents.append(m["content"])
            m = {**m, "content": _SENTINEL.format(len(contents) - 1)}
        marked.append(m)
    return marked, contents


_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")


def _harmony_messages(pieces: list[str]) -> list[tuple[str, str, str, str]]:
    """(channel, recipient, body, end marker) of each harmony message in a generated turn, from its text
    split at the control tokens (`ChatTemplate._split_at_markers`: markers at odd indices), so a body
    holding a marker's characters is read whole. The first message's `<|start|>assistant` is the
    prompt's; later ones start with their own. One pass over the markers."""
    out, begin, at, close = [], 0, None, None
    for k in [*range(1, len(pieces), 2), len(pieces)]:  # each marker, then the end of the turn
        marker = pieces[k] if k < len(pieces) else "<|start|>"
        if marker == "<|message|>" and at is None:
            at = k
        elif marker in _HARMONY_ENDS and at is not None and close is None:
            close = k
        elif marker == "<|start|>":
            if at is not None:
                header = pieces[begin:at]
                channel = next(
                    (header[i + 1] for i in range(1, len(header), 2) if header[i] == "<|channel|>"), ""
                )
                channel = re.match(r"\s*(\w*)", channel).group(1)
                recipient = re.search(r"\bto=([^\s<]+)", "".join(header))
                body = "".join(pieces[at + 1 : close or k])
                out.append(
                    (channel, recipient.group(1) if recipient else "", body, pieces[close] if close else "")
                )
            begin, at, close = k + 1, None, None
    return out


_BLANKS = re.compile(r"\s*")


def _hermes_calls(text: str) -> list[tuple[int, str | None]]:
    """(where its `<tool_call>` starts, body) of each call in a hermes turn's text; the body is None for
    one left unterminated (the last). A body is the JSON object that opens it when a `</tool_call>`
    follows that object: one inside the object's strings (code printing the tag, echoing a tool's output)
    is text the model wrote, not the close (the decoded text no longer tells a control token from its
    characters), and an object no close follows is unterminated. Otherwise it runs to the next
    `</tool_call>`, and `_parse_call` says what is wrong with it — unless another `<tool_call>` comes
    first: then this one was text (reasoning that names the tag, "I'll write a <tool_call> block"), and
    the call is the later one (read from the first, the model's well-formed call failed)."""
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while (opener := text.find("<tool_call>", pos)) >= 0:
        start = opener + len("<tool_call>")
        end = text.find("</tool_call>", start)
        try:
            _, after = decoder.raw_decode(text, _BLANKS.match(text, start).end())
        except (ValueError, RecursionError):  # not JSON: the text to the next close is its body
            later = text.rfind("<tool_call>", start, len(text) if end < 0 else end)
            if later >= 0:
                pos = later
                continue
        else:
            close = text.find("</tool_call>", after)
            if close < 0 or not text[after:close].strip():
                end = close
        if end < 0:
            calls.append((opener, None))
            break
        calls.append((opener, text[start:end]))
        pos = end + len("</tool_call>")
    return calls


def _json(text: str):
    """json.loads, a nesting too deep for Python's parser (model output: `[[[[…`) a decode error too
    (it raised RecursionError out of the rollout, failing the group)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def _parse_call(body: str) -> tuple[str, dict | str, str | None]:
    try:
        call = _json(body)
    except json.JSONDecodeError as e:
        return "", body, f"tool call is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return "", body, 'tool call must be a JSON object with a string "name"'
    args = call.get("arguments", call.get("parameters"))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = _json(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return call["name"], body, 'tool call needs an "arguments" JSON object'
    return call["name"], args, None


def _parse_arguments(name: str, body: str) -> tuple[str, dict | str, str | None]:
    """A harmony call's body: the arguments object itself (the name is the recipient)."""
    try:
        args = _json(body)
    except json.JSONDecodeError as e:
        return name, body, f"tool call is not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(args, dict):
        return name, body, "tool call arguments must be a JSON object"
    return name, args, None
