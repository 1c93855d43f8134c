"""The flag matrix's shaped-reward environment, its launcher, and the checks it makes inside the run
(tests/test_flag_matrix.py).

`retool_shaped` is `--env retool` with a shaped reward in the spirit of the one envs/retool.py suggests
trying: a wrong answer scores −0.9 plus 0.01 per successful tool call (so −0.9, −0.89, …: rewards that
are not binary fractions, and every group of wrong answers with as many calls each, which is most groups
of the tiny models, is a group of equal non-dyadic rewards whose advantages must be exactly zero). With
the matrix's G = 3 these values are ones whose float32 mean is not the value itself (−0.9 … −0.85; of
the 0.1 steps only −0.9 is, and a mean of 4 equal floats is always exact), so the old float32 advantages
without the equality test would be non-zero for every such group. Not an `envs/` environment:
the matrix runs the trainer through `python tests/matrix_env.py <trainer args>` (also under torchrun),
which registers it and calls train_async_grpo.main.

The launcher also wraps three of the trainer's functions to check what the test cannot see from the
run's files, and writes one JSON line per check to <output-dir>/matrix_checks.jsonl (the test reads it):
  loss        every grpo_loss call (every rank) against a plain loop over its tokens, with --loss-norm
              and --kl-beta as given on the command line (the option, not what the trainer passed on)
  tokens      every step: the loss tokens the ranks report add up to the batch's trained tokens
  truncation  the first step: the behaviour logprobs against the starting weights' UNtruncated ones
              (a separate copy of the model): truncation raises some, no truncation leaves them equal
  advantages  every group of equal rewards has advantages of exactly 0
"""

import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from envs import ENVS, retool  # noqa: E402

SYSTEM_PROMPT = retool.SYSTEM_PROMPT
CHECKS = "matrix_checks.jsonl"


def make_episode(row: dict, sandbox=None) -> retool.Episode:
    return retool.make_episode(row, sandbox=sandbox, wrong_reward=-0.9, tool_bonus=0.01)


def reference_loss(t: dict, loss_norm: str, kl_beta: float, kw: dict) -> float:
    """loss.py's formula, one token at a time in float64 over the lists in `t` (mask 1 tokens only)."""
    sums, counts = {}, {}
    for k, on in enumerate(t["mask"]):
        if not on:
            continue
        lp, old, adv = t["logprobs"][k], t["old"][k], t["advantages"][k]
        r = math.exp(lp - old)
        w = min(math.exp(old - t["behaviour"][k]), kw["is_cap"])
        clipped = min(max(r, 1 - kw["eps_low"]), 1 + kw["eps_high"])
        loss = -w * min(r * adv, clipped * adv)
        if kl_beta > 0:
            d = t["ref"][k] - lp
            loss += kl_beta * (math.exp(d) - d - 1)
        s = t["seq_index"][k]
        sums[s], counts[s] = sums.get(s, 0.0) + loss, counts.get(s, 0) + 1
    if loss_norm == "token":
        return sum(sums.values()) / float(kw["total_tokens"])
    return sum(sums[s] / counts[s] for s in sums) / float(kw["num_sequences"])


def install_checks(args) -> None:
    import torch

    import batches
    import train_async_grpo
    import trainer

    path = Path(args.output_dir) / CHECKS
    path.parent.mkdir(parents=True, exist_ok=True)

    def record(check: str, ok: bool, **details) -> None:
        with open(path, "a") as f:
            line = {"check": check, "ok": bool(ok), "rank": os.environ.get("RANK", "0")} | details
            f.write(json.dumps(line) + "\n")

    real_loss, real_step, real_batch = trainer.grpo_loss, train_async_grpo.train_step, batches.batch_sequences

    def grpo_loss(logprobs, old_logprobs, behaviour_logprobs, advantages, loss_mask, seq_index, **kw):
        loss, metrics = real_loss(
            logprobs, old_logprobs, behaviour_logprobs, advantages, loss_mask, seq_index, **kw
        )  # fmt: skip
        ref = kw.get("ref_logprobs")
        if args.kl_beta > 0 and ref is None:
            record("loss", False, why="--kl-beta is on but the loss got no reference logprobs")
            return loss, metrics
        t = {"logprobs": logprobs, "old": old_logprobs, "behaviour": behaviour_logprobs, "ref": ref,
             "advantages": advantages, "mask": loss_mask, "seq_index": seq_index}  # fmt: skip
        t = {k: v.detach().double().tolist() if v is not None else None for k, v in t.items()}
        t["seq_index"] = [int(s) for s in t["seq_index"]]
        kw = {"eps_low": 0.2, "eps_high": 0.28, "is_cap": 2.0} | kw
        expected = reference_loss(t, args.loss_norm, args.kl_beta, kw)
        other = reference_loss(t, "sequence" if args.loss_norm == "token" else "token", args.kl_beta, kw)
        tol = dict(rel_tol=1e-4, abs_tol=1e-5)
        # the norms can differ only where sequences of different lengths carry an advantage
        lengths = {}
        for s, m, a in zip(t["seq_index"], t["mask"], t["advantages"]):
            if m and a:
                lengths[s] = lengths.get(s, 0) + 1
        record(
            "loss", math.isclose(loss.item(), expected, **tol), loss=loss.item(), expected=expected,
            other=other, discriminates=not math.isclose(expected, other, **tol),  # other: the other norm
            lengths_differ=len(set(lengths.values())) > 1,
        )  # fmt: skip
        return loss, metrics

    truncation_checked = False  # only rank 0 calls train_async_grpo.train_step (the others follow it)

    def train_step(model, ref_model, optimizer, scheduler, seqs, *a, **kw):
        nonlocal truncation_checked
        if not truncation_checked:
            truncation_checked = True
            raised = behaviour_minus_untruncated(args, seqs, torch)
            record("truncation", True, max_raise=max(raised), max_abs=max(map(abs, raised)))
        metrics = real_step(model, ref_model, optimizer, scheduler, seqs, *a, **kw)
        trained = float(sum(sum(s["mask"]) for s in seqs))
        record("tokens", metrics["train/loss_tokens"] == trained, reported=metrics["train/loss_tokens"],
               batch=trained)  # fmt: skip
        return metrics

    def batch_sequences(groups):
        for g in groups:
            if len(set(g.rewards)) == 1:
                ok = all(a == 0.0 for a in g.advantages)
                record("advantages", ok, rewards=g.rewards, advantages=g.advantages)
        return real_batch(groups)

    trainer.grpo_loss = grpo_loss
    train_async_grpo.train_step = train_step
    train_async_grpo.batch_sequences = batch_sequences


def behaviour_minus_untruncated(args, seqs: list[dict], torch) -> list[float]:
    """vLLM's logprob minus log softmax(logits / T) of the starting weights, on every trained token of
    the first step's batch (the servers hold those weights then). Truncation renormalises over the kept
    set, so it can only raise a logprob."""
    from transformers import AutoModelForCausalLM

    # LoRA: the base with the adapter resumed (a LoRA checkpoint holds it alone), or alone (a fresh B is 0)
    if args.lora_rank:
        import lora

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        if args.resume:
            alpha = args.lora_alpha or 2 * args.lora_rank
            model = lora.attach(model, args.lora_rank, alpha, args.lora_targets.split(","), torch.float32)
            lora.read_adapter(model, args.resume)
        model.eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.resume or args.model, dtype=torch.float32).eval()
    raised = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s["ids"]])
            logits = model(input_ids=ids).logits[0, :-1].double() / args.temperature  # (T−1, V)
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
            raised += [b - p for b, p, on in zip(s["behaviour"][1:], lp, s["mask"][1:]) if on]
    return raised


if __name__ == "__main__":
    ENVS["retool_shaped"] = "tests.matrix_env"  # before the trainer builds its --env choices
    import train_async_grpo

    install_checks(train_async_grpo.parser.parse_args(sys.argv[1:]))
    train_async_grpo.main(sys.argv[1:])
