"""What a step writes: the rollout/ metrics of its batch (metrics.jsonl; the loop adds train/, sync/,
perf/ and eval/), the experiment tracker that mirrors them (none, tensorboard, wandb or trackio: only
when asked and installed), and the completions.jsonl rows that scripts/view_rollouts.py shows.
"""

import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch


# ---------------------------------------------------------------------------------------------------
# TRACKERS: a do-nothing one unless --report-to names one that is installed
# ---------------------------------------------------------------------------------------------------
class NoTracker:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class TensorBoardTracker:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def finish(self) -> None:
        self.writer.close()


class ModuleTracker:  # wandb and trackio share init/log/finish
    def __init__(self, module, project: str, config: dict, name: str):
        self.module = module
        module.init(project=project, config=config, name=name)

    def log(self, metrics: dict, step: int) -> None:
        self.module.log(metrics, step=step)

    def finish(self) -> None:
        self.module.finish()


def make_tracker(report_to: str, out_dir: Path, config: dict):
    if report_to == "none":
        return NoTracker()
    try:
        if report_to == "tensorboard":
            return TensorBoardTracker(out_dir / "tensorboard")
        import importlib

        return ModuleTracker(importlib.import_module(report_to), "async-grpo", config, out_dir.name)
    except ImportError as e:
        print(f"--report-to {report_to}: not installed ({e}); logging to metrics.jsonl only", file=sys.stderr)
        return NoTracker()


def open_jsonl(path: Path):
    """`path` opened to append lines to: a killed run may have left its last line cut, and the first
    line of a resumed run appended to it would be lost with it (a reader skips the joined line)."""
    f = open(path, "a+b")
    if f.tell() > 0:
        f.seek(f.tell() - 1)
        if f.read(1) != b"\n":
            f.write(b"\n")
    f.close()
    return open(path, "a")


def json_line(values: dict) -> str:
    """`values` as one line of strict JSON, a non-finite number (a skipped step's loss) as null: bare
    `NaN`, as json.dumps writes it, is refused by jq, JavaScript and other strict readers."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
    return json.dumps(finite) + "\n"


# ---------------------------------------------------------------------------------------------------
# A STEP'S LINE IN metrics.jsonl: its rollout/ and perf/ keys (train/ from train_step, sync/ from the sync)
# ---------------------------------------------------------------------------------------------------
LAG_BUCKETS = 4  # token-lag histogram: rollout/token_lag_0 .. _3, then rollout/token_lag_4plus


def rollout_metrics(
    groups, dropped: int, skipped: int, taken=None, version: int | None = None
) -> dict[str, float]:
    """A step's rollout/ keys. Rewards and accuracy are those of every group sampled (`taken`, where
    given): of the trained groups alone they left out the equal-reward groups the loss skips, all
    solved or all failed, so a policy that solved more read no better. The rest is of the trained groups."""
    rewards = [r for g in (groups if taken is None else taken) for r in g.rewards]
    advs = [a for g in groups for a in g.advantages]
    comps = [c for g in groups for c in g.completions]
    t = torch.tensor(rewards)
    a = torch.tensor(advs)
    m = {
        "rollout/reward_mean": t.mean().item(),
        "rollout/reward_std": t.std(correction=0).item(),
        "rollout/reward_min": t.min().item(),
        "rollout/reward_max": t.max().item(),
        "rollout/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "rollout/advantage_mean": a.mean().item(),
        "rollout/advantage_std": a.std(correction=0).item(),
        "rollout/advantage_min": a.min().item(),
        "rollout/advantage_max": a.max().item(),
        "rollout/staleness_mean": sum(g.staleness for g in groups) / len(groups),
        "rollout/staleness_max": float(max(g.staleness for g in groups)),
        "rollout/dropped_stale": float(dropped),
        "rollout/skipped_equal_reward": float(skipped),
    }
    # group_metrics has a fixed key set: average the per-group means, add up the counts.
    sums = {"rollout/tool_failures", "rollout/tool_calls", "rollout/generated_tokens",
            "rollout/generation_s", "rollout/tool_s", "rollout/completions",
            "rollout/reward_timeouts"}  # fmt: skip
    for k in groups[0].metrics:
        vals = [g.metrics[k] for g in groups]
        m[k] = sum(vals) if k in sums else max(vals) if k.endswith("_max") else sum(vals) / len(vals)
    m["rollout/tool_failure_rate"] = m["rollout/tool_failures"] / max(1.0, m["rollout/tool_calls"])
    m["rollout/completion_len_min"] = float(min(len(c) for c in comps))
    versions = [c.model_versions for c in comps if c.turns]
    m["rollout/multi_version_frac"] = sum(v[0] != v[1] for v in versions) / max(1, len(versions))
    if taken is not None:  # length bias of what reaches the loss: trained vs every group taken off the queue
        admitted = [len(c) for g in taken for c in g.completions]
        m["rollout/admitted_completions"] = float(len(admitted))
        m["rollout/admitted_len_mean"] = sum(admitted) / max(1, len(admitted))
        m["rollout/trained_vs_admitted_len"] = m["rollout/completion_len_mean"] / max(
            1e-9, m["rollout/admitted_len_mean"]
        )
    if version is not None:  # per generated token: trainer version − oldest version of its turn (≥ true lag)
        lags = Counter()
        for c in comps:
            for turn in c.turns:
                lags[version - turn.model_versions[0]] += len(turn.generated_ids)
        n = max(1, sum(lags.values()))
        m["rollout/token_lag_mean"] = sum(k * v for k, v in lags.items()) / n
        m["rollout/token_lag_max"] = float(max(lags, default=0))
        for b in range(LAG_BUCKETS):
            m[f"rollout/token_lag_{b}"] = lags.get(b, 0) / n
        m[f"rollout/token_lag_{LAG_BUCKETS}plus"] = sum(v for k, v in lags.items() if k >= LAG_BUCKETS) / n
    return m


def perf_metrics(
    worker, request_s: float, step_s: float, wait_s: float, train_s: float, seqs, generated_tokens: float
) -> dict[str, float]:
    """The perf/ metrics of one step; `request_s`: the seconds the worker's requests spent in flight
    during it (their sum over requests)."""
    return {
        "perf/requests_in_flight": request_s / step_s,
        "perf/step_s": step_s,
        "perf/wait_s": wait_s,
        "perf/idle_frac": wait_s / step_s,
        "perf/train_s": train_s,
        "perf/gen_tok_s": generated_tokens / step_s,
        "perf/train_tok_s": sum(len(s["ids"]) for s in seqs) / train_s,
        "perf/groups_failed": float(worker.stats.groups_failed),
        "perf/groups_retried": float(worker.stats.groups_retried),
        "perf/servers_down": float(len(worker.client.down)),
    }


# ---------------------------------------------------------------------------------------------------
# ROLLOUT VIEWER: the completions.jsonl rows
# ---------------------------------------------------------------------------------------------------
# A completions.jsonl row holds at most this many completion tokens (token arrays and "text"; the rest
# is counted in "tokens_dropped"), tool results of at most 1000 characters and prompt messages of at most
# 2000: with ≈ 50 bytes of JSON per token a row stays under ~250 KB.
def rollout_counters(ws, cs) -> str:
    """The shutdown's stderr line: what the rollout worker (`ws`, rollout.WorkerStats) and its client
    (`cs`, rollout.ClientStats) counted over the run."""
    return (
        f"rollout counters: groups started {ws.groups_started}, done {ws.groups_done}, retried "
        f"{ws.groups_retried}, failed {ws.groups_failed}, discarded {ws.groups_discarded}; "
        f"servers taken out {cs.servers_down}, back {cs.servers_readmitted}; "
        f"requests {cs.requests}, retries {cs.retries}"
    )


MAX_LOGGED_TOKENS = 4096


def logged_completions(groups) -> list[tuple[int, int, int]]:
    """(group index, completion index, sequence index in batch_sequences) of the completions written to
    completions.jsonl: in each of the first two groups, the best- and the worst-rewarded completion (the
    contrast the group's advantages are made of; the first two when all rewards are equal)."""
    chosen, first_seq = [], 0
    for gi, g in enumerate(groups):
        if gi < 2:
            best = max(range(len(g.rewards)), key=lambda i: g.rewards[i])
            worst = min(range(len(g.rewards)), key=lambda i: g.rewards[i])
            for ci in [0, 1] if best == worst else [best, worst]:
                chosen.append((gi, ci, first_seq + ci))
        first_seq += len(g.completions)
    return chosen


def mark_logged(groups, seqs: list[dict], step: int, every: int) -> list[tuple[int, int, int]]:
    """The completions written to completions.jsonl this step (every `every` steps and the first one);
    their sequences get a "trace" key, so that train_step returns their logprobs."""
    logged = logged_completions(groups) if (step + 1) % every == 0 or step == 0 else []
    for _, _, i in logged:
        seqs[i]["trace"] = i
    return logged


def keep_traced(traced: dict[int, list[float]], mb_seqs: list[dict], logprobs: torch.Tensor) -> None:
    """For the rollout viewer: the logprobs of this micro-batch's sequences that carry a "trace" key
    (its value is the key in `traced`), over all their tokens, detached. A filler micro-batch copies
    a real one, so it writes the same values again."""
    offset = 0
    for s in mb_seqs:
        n = len(s["ids"])
        if "trace" in s:
            traced[s["trace"]] = logprobs[offset : offset + n].detach().float().cpu().tolist()
        offset += n


# The trainer process writing completions.jsonl: a resumed run appends the steps after its checkpoint
# again, and the viewer keeps each step's rows of the last process that wrote it.
WRITER = f"{os.getpid()}-{time.time_ns()}"


def write_completions(
    completions_file, groups, logged, traced: dict, step: int, tokenizer, is_cap: float
) -> None:
    """The rows of the completions `logged` this step (logged_completions), with the trainer's logprobs
    of each (`traced`, keyed by sequence index), and the process that wrote them (WRITER)."""
    for gi, ci, i in logged:
        row = trajectory_record(groups[gi], ci, step, tokenizer, traced.get(i), is_cap)
        completions_file.write(json.dumps(row | {"writer": WRITER}) + "\n")
    completions_file.flush()


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text, so that "".join(pieces) == decode(ids) for byte-level BPE (Qwen, Llama 3): a
    character split over several tokens goes whole to the token that completes it, the others get ""."""
    pieces, start = [], 0
    for k in range(len(ids)):
        text = tokenizer.decode(ids[start : k + 1], skip_special_tokens=False)
        if text.endswith("\ufffd") and k - start < 3:  # an incomplete UTF-8 character so far
            pieces.append("")
            continue
        pieces.append(text)
        start = k + 1
    if start < len(ids):  # the ids end inside a character (a length cut): what they hold, to the last
        pieces[-1] = tokenizer.decode(ids[start:], skip_special_tokens=False)
    return pieces


def tool_output_kinds(pieces: list[str], results: list[str]) -> str:
    """For the tokens a tool turn appended (rendered template suffix): "t" where a token's text overlaps
    a tool result, "c" (chat template: turn closer, role headers, <tool_response> tags) elsewhere. The
    template inserts each result verbatim, so its first occurrence after the previous one is where it
    landed; a result cut by the context budget matches as far as it goes."""
    text, spans, pos = "".join(pieces), [], 0
    for r in results:
        i = text.find(r[:64], pos) if r else -1
        if i < 0:  # cut by the context budget: the longest head of r that ends the text
            n = next((n for n in range(min(len(r), len(text) - pos), 0, -1) if text.endswith(r[:n])), 0)
            i = len(text) - n if n else -1
        if i < 0:
            continue
        n = 0
        while n < len(r) and i + n < len(text) and text[i + n] == r[n]:
            n += 1
        spans.append((i, i + n))
        pos = i + n
    kinds, start = [], 0
    for p in pieces:
        end = start + len(p)
        kinds.append("t" if any(a < max(end, start + 1) and start < b for a, b in spans) else "c")
        start = end
    return "".join(kinds)


def trajectory_record(
    group, index: int, step: int, tokenizer, trainer_logprobs: list[float] | None = None,
    is_cap: float = math.inf,
) -> dict:  # fmt: skip
    """One completions.jsonl row: what scripts/view_rollouts.py shows. The token arrays run over the
    completion (not the prompt), aligned with completion_ids: mask 1 = trained; kind "m" model-generated
    (trained), "t" tool output, "c" chat-template glue; behaviour_logprob μ (null off the mask);
    trainer_logprob π_old from the forward of the step that trained it (every token); is_weight the
    loss's min(π_old/μ, C) (null off the mask). `turns` give each turn's span: `generated` tokens, then
    `appended` ones (tool responses + next header)."""
    completion = group.completions[index]
    ids = completion.completion_ids[:MAX_LOGGED_TOKENS]
    n_prompt = len(group.prompt_ids)
    trainer = (trainer_logprobs or [])[n_prompt : n_prompt + len(ids)]
    trainer = trainer if len(trainer) == len(ids) else [None] * len(ids)
    pieces, kinds, turns, calls = [], [], [], []
    for t_index, t in enumerate(completion.turns):
        # Every turn's calls, past the token cap too: the viewer counts them and files the row by them.
        calls += [
            {"name": c.name, "arguments": c.arguments, "result": c.result[:1000], "failed": c.failed,
             "duration_s": round(c.duration_s, 4), "turn": t_index}
            for c in t.tool_calls
        ]  # fmt: skip
        start = len(pieces)
        if start >= len(ids):
            continue
        gen = token_pieces(tokenizer, list(t.generated_ids))
        app = token_pieces(tokenizer, list(t.appended_ids))
        pieces += gen + app
        kinds.append("m" * len(gen) + tool_output_kinds(app, [c.result for c in t.tool_calls]))
        turns.append({
            "start": start, "generated": len(gen), "appended": len(app),
            "model_versions": list(t.model_versions), "finish_reason": t.finish_reason,
            "generation_s": round(t.generation_s, 4), "tool_s": round(t.tool_s, 4),
        })  # fmt: skip
    mask = completion.loss_mask[: len(ids)]
    mu = completion.behaviour_logprobs[: len(ids)]
    rnd = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "step": step,
        "question": group.row.get("question"),
        "answer": group.row.get("answer"),
        "text": tokenizer.decode(group.prompt_ids + ids, skip_special_tokens=False),
        "reward": completion.reward,
        "stop_reason": completion.stop_reason,
        "tool_calls": calls,
        "admitted_version": group.admitted_version,
        "row_index": group.row.get("_index"),
        "advantage": group.advantages[index],
        "completion_index": index,
        "staleness": getattr(group, "staleness", None),
        "model_versions": list(completion.model_versions),
        "prompt_tokens": n_prompt,
        "prompt_messages": [
            {"role": m.get("role"), "content": str(m.get("content"))[:2000]} for m in group.prompt_messages
        ],
        "turns": turns,
        "tokens": {
            "ids": ids,
            "pieces": pieces[: len(ids)],
            "mask": mask,
            "kind": "".join(kinds)[: len(ids)],
            "behaviour_logprob": [rnd(b) if m else None for b, m in zip(mu, mask)],
            "trainer_logprob": [rnd(p) for p in trainer],
            "is_weight": [
                rnd(min(math.exp(p - b), is_cap)) if m and p is not None else None
                for p, b, m in zip(trainer, mu, mask)
            ],
        },
        "tokens_dropped": len(completion) - len(ids),
    }
