"""Held-out evaluation (--eval-every): greedy (temperature 0) rollouts of the held-out rows through the
same servers and the same tool loop as training, while training rollouts keep running. Returns the eval/
metrics of one metrics.jsonl line. The trainer runs it at the start (a step-0 line with only eval/ keys,
before rollouts begin; not on resume), every --eval-every steps and at the last step.
"""

import asyncio
import math
import sys

from rollout import RolloutContext, VLLMClient, prompt_ids_with_room, score, tool_loop_rollout
from sampling import Sampling


async def evaluate(
    urls, model_name, template, make_episode, rows, args, expected_version
) -> dict[str, float]:
    """Greedy (temperature 0) rollouts of held-out rows with the same tool loop as training."""
    client = VLLMClient(
        urls,
        model_name,
        max_inflight=32,
        request_timeout_s=args.batch_timeout,
        expected_version=expected_version,
    )
    await client.open()
    ctx = RolloutContext(
        client=client, template=template, sampling=Sampling(temperature=0.0).request_fields(),
        max_turns=args.max_turns, max_calls_per_turn=args.max_calls_per_turn,
        max_context=args.max_context, version=lambda: 0,
        tool_semaphore=asyncio.Semaphore(args.sandbox_workers),
    )  # fmt: skip

    async def one(row):
        ep = make_episode(row)
        # no room to answer: a failed row, as in training (it scored 0 in eval/accuracy)
        comp = await tool_loop_rollout(ctx, ep, prompt_ids_with_room(template, ep.messages, args.max_context))
        # Off the event loop: a reward check may take up to envs.verify.DEADLINE_S. `score`: a reward's
        # sys.exit() fails its row, as in training, instead of ending the event loop (and the trainer).
        reward = await asyncio.to_thread(score, ep, comp)
        return reward, len(comp.tool_calls), getattr(ep, "reward_timeouts", 0)

    try:
        results = await asyncio.gather(*(one(r) for r in rows), return_exceptions=True)
    finally:
        await client.close()
    ok = [r for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:  # left out of the means and counted; named here, as the rollout worker names a failed group
        why = f"{type(errors[0]).__name__}: {errors[0]}"
        print(
            f"eval: {len(errors)} of {len(rows)} rows failed, the first: {why}", file=sys.stderr, flush=True
        )
    scored = len(ok) or math.nan  # no row scored: every mean is NaN, with the same keys
    return {
        "eval/accuracy": sum(r >= 1.0 for r, _, _ in ok) / scored,
        "eval/tool_call_rate": sum(n > 0 for _, n, _ in ok) / scored,
        "eval/tool_calls_per_completion": sum(n for _, n, _ in ok) / scored,
        "eval/failed": float(len(rows) - len(ok)),
        "eval/reward_timeouts": float(sum(t for _, _, t in ok)),
    }
