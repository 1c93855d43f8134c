"""Rollout records: what one group of multi-turn tool-use completions holds, and the one place that
keeps the token arrays aligned.

The invariant (slime PR 1861 found four ways to break it): for every completion,
`completion_ids`, `behaviour_logprobs` and `loss_mask` have the same length; exactly the tokens the model
generated have mask 1 and a real logprob; tool and template tokens have mask 0 and logprob 0.0.
It holds by construction: a `TurnRecord` is frozen and refuses generated ids without one finite logprob
each, and `RolloutCompletion.add_turn` / `continue_turn` / `append_context` are the only ways
tokens enter a completion. The flattened views are derived from the turns, never stored beside them.
"""

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

# The closed set of reasons a completion ended. Truncated = cut short by a budget or an abort;
# `eos` (the model finished) and `env_done` (the environment ended the episode) are natural ends.
StopReason = Literal["eos", "max_turns", "context_budget", "env_done", "aborted"]
STOP_REASONS: tuple[str, ...] = ("eos", "max_turns", "context_budget", "env_done", "aborted")
TRUNCATING: frozenset[str] = frozenset({"max_turns", "context_budget", "aborted"})


class TokenAccountingError(ValueError):
    """Tokens that would break the equal-length invariant were refused."""


@dataclass(frozen=True)
class ToolCallRecord:
    name: str  # tool name as the model wrote it ("" when the call could not be parsed)
    arguments: dict | str  # parsed arguments, or the raw text when it was not valid JSON
    result: str  # the text sent back to the model (the error message when failed)
    failed: bool  # unparseable call, unknown tool, bad arguments, or the tool raised
    duration_s: float = 0.0


@dataclass(frozen=True)
class TurnRecord:
    generated_ids: tuple[int, ...]  # exactly the ids vLLM returned for this turn; all trained (mask 1)
    generated_logprobs: tuple[float, ...]  # behaviour logprob μ of each generated id, same length
    finish_reason: str  # what vLLM said: "stop" (eos / stop token), "length", "abort"
    model_versions: tuple[int, int]  # oldest and newest trainer version while this turn generated
    tool_calls: tuple[ToolCallRecord, ...] = ()  # parsed from the generated text, with their results
    appended_ids: tuple[int, ...] = ()  # after the turn: tool responses + next assistant header (mask 0)
    requests: int = 1  # vLLM requests that generated it (> 1: continued after a call, see continue_turn)
    servers: tuple[str, ...] = ()  # the URL of the vLLM server that answered each of those requests
    generation_s: float = 0.0
    tool_s: float = 0.0
    # time.monotonic() as its first request went out (CLOCK_MONOTONIC: the rollout process's clock is the
    # trainer's): whether it began before a server was re-synced (fidelity.SyncChecks)
    started_s: float = 0.0

    def __post_init__(self):
        if len(self.generated_ids) != len(self.generated_logprobs):
            raise TokenAccountingError(
                f"{len(self.generated_ids)} generated ids but {len(self.generated_logprobs)} logprobs"
            )
        for lp in self.generated_logprobs:
            if lp is None or not math.isfinite(lp):
                raise TokenAccountingError(f"generated token without a finite logprob ({lp!r})")


@dataclass
class TaggedMessage:
    message: dict  # a chat message as the template renders it
    generated: bool  # True for assistant messages the model wrote, False for prompt and tool messages


@dataclass
class RolloutCompletion:
    prompt_len: int  # tokens in the group's prompt (the budget counts prompt + completion)
    prompt_messages: list[dict]  # the episode's initial messages, stored once
    turns: list[TurnRecord] = field(default_factory=list)
    trajectory: list[TaggedMessage] = field(default_factory=list)  # assistant/tool messages after the prompt
    stop_reason: StopReason | None = None
    reward: float = 0.0

    # --- the only mutators of the token arrays -------------------------------------------------------
    def add_turn(self, turn: TurnRecord) -> None:
        if self.turns and not self.turns[-1].appended_ids and self.turns[-1].tool_calls:
            raise TokenAccountingError("a new turn after tool calls needs their response ids appended first")
        self.turns.append(turn)

    def continue_turn(self, more: TurnRecord) -> None:
        """More generated ids of the same assistant message: a request that continued the last turn
        (hermes parallel calls: after a stop at `</tool_call>` the model may open another call). The turn's
        ids stay exactly what vLLM returned, request after request."""
        if not self.turns or self.turns[-1].appended_ids:
            raise TokenAccountingError("a continuation needs an open turn (no context ids after it yet)")
        last = self.turns[-1]
        self.turns[-1] = replace(
            last,
            generated_ids=last.generated_ids + more.generated_ids,
            generated_logprobs=last.generated_logprobs + more.generated_logprobs,
            finish_reason=more.finish_reason,
            model_versions=(
                min(last.model_versions[0], more.model_versions[0]),
                max(last.model_versions[1], more.model_versions[1]),
            ),
            # what the environment appended after the continuation (tool responses, template glue)
            appended_ids=more.appended_ids,  # the open turn had none
            tool_calls=last.tool_calls + more.tool_calls,
            requests=last.requests + more.requests,
            servers=last.servers + more.servers,
            generation_s=last.generation_s + more.generation_s,
            tool_s=last.tool_s + more.tool_s,
        )

    def append_context(
        self, ids: list[int], tool_calls: tuple[ToolCallRecord, ...] = (), tool_s: float = 0.0
    ):
        """Non-generated ids (tool responses, template glue) after the last turn: mask 0, logprob 0."""
        if not self.turns:
            raise TokenAccountingError("context ids before any generated turn belong in the prompt")
        last = self.turns[-1]
        self.turns[-1] = replace(
            last,
            appended_ids=last.appended_ids + tuple(ids),
            tool_calls=last.tool_calls + tuple(tool_calls),
            tool_s=last.tool_s + tool_s,
        )

    # --- flattened views the trainer uses --------------------------------------------------------------
    @property
    def completion_ids(self) -> list[int]:
        return [i for t in self.turns for i in (*t.generated_ids, *t.appended_ids)]

    @property
    def behaviour_logprobs(self) -> list[float]:
        """μ on generated tokens, 0.0 on tool/template tokens."""
        return [lp for t in self.turns for lp in (*t.generated_logprobs, *(0.0,) * len(t.appended_ids))]

    @property
    def loss_mask(self) -> list[int]:
        """1 = a token the model generated (trained), 0 = tool/template context (not trained)."""
        return [m for t in self.turns for m in (*(1,) * len(t.generated_ids), *(0,) * len(t.appended_ids))]

    def __len__(self) -> int:
        return sum(len(t.generated_ids) + len(t.appended_ids) for t in self.turns)

    @property
    def truncated(self) -> bool:
        return self.stop_reason in TRUNCATING

    @property
    def tool_calls(self) -> list[ToolCallRecord]:
        return [c for t in self.turns for c in t.tool_calls]

    @property
    def messages(self) -> list[dict]:
        """Prompt messages followed by every assistant and tool message: what rewards see."""
        return self.prompt_messages + [m.message for m in self.trajectory]

    @property
    def model_versions(self) -> tuple[int, int]:
        if not self.turns:
            return (-1, -1)
        return (min(t.model_versions[0] for t in self.turns), max(t.model_versions[1] for t in self.turns))


@dataclass
class RolloutGroup:
    prompt_messages: list[dict]
    prompt_ids: list[int]
    row: dict  # the dataset row (answer included), for logging and evaluation
    completions: list[RolloutCompletion]
    rewards: list[float]
    advantages: list[float]
    admitted_version: int  # trainer version when the group started; staleness is measured from it
    metrics: dict[str, float] = field(default_factory=dict)  # per-group rollout stats, see group_metrics

    @property
    def model_versions(self) -> tuple[int, int]:
        """Oldest and newest trainer version that produced any token of the group."""
        vs = [c.model_versions for c in self.completions if c.turns]
        return (min(v[0] for v in vs), max(v[1] for v in vs)) if vs else (-1, -1)


def group_metrics(completions: list[RolloutCompletion]) -> dict[str, float]:
    """Per-group rollout stats with a fixed key set (every stop reason present, even at 0), so batches
    mixing groups with and without tool calls never drop keys (seed 003's collator bug)."""
    n = len(completions)
    calls = [c.tool_calls for c in completions]
    n_calls = sum(len(c) for c in calls)
    stops = Counter(c.stop_reason for c in completions)
    gen_tokens = sum(len(t.generated_ids) for c in completions for t in c.turns)
    metrics = {
        "rollout/completions": float(n),
        "rollout/turns_per_completion": sum(len(c.turns) for c in completions) / n,
        "rollout/tool_calls_per_completion": n_calls / n,
        "rollout/tool_failures": float(sum(f.failed for c in calls for f in c)),
        "rollout/tool_calls": float(n_calls),
        "rollout/generated_tokens": float(gen_tokens),
        "rollout/completion_len_mean": sum(len(c) for c in completions) / n,
        "rollout/completion_len_max": float(max(len(c) for c in completions)),
        "rollout/generation_s": sum(t.generation_s for c in completions for t in c.turns),
        "rollout/tool_s": sum(t.tool_s for c in completions for t in c.turns),
        "rollout/truncated_frac": sum(c.truncated for c in completions) / n,
    }
    for reason in STOP_REASONS:
        metrics[f"rollout/stop_{reason}"] = stops.get(reason, 0) / n
    return metrics
