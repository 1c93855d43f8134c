"""The rollout worker: multi-turn tool-use rollouts, token-in/token-out, in a background asyncio thread.

One sample's path: env.make_episode(row) gives messages and tools → the chat template
(chat_format.py) renders the prompt ids once → POST /v1/completions with the ids (return_token_ids,
logprobs=0) → the ids and behaviour logprobs vLLM returns are recorded as they are → tool calls are
parsed from the decoded text (decoding is for reading only; the model's ids are never re-encoded) → the
tools run (sandbox subprocesses, awaited, so the loop never blocks) → the ids of the tool turn are the
chat template's rendering of just that suffix → next prompt = previous prompt + generated ids +
tool-response ids → … → the env scores the group, advantages are computed, and the scored
`RolloutGroup` goes on a bounded `queue.Queue`.

Staleness, in model versions (one version = one weight sync = --sync-every trainer steps; G_v groups per
version): starting group k only while k < (version + 1 + max_staleness) · G_v (PipelineRL/AReaL-style
admission) keeps the worker at most `max_staleness` versions ahead of the trainer in admission order.
Groups finish in completion order, though, and a group is as slow as its slowest completion, so a long
group can still arrive later than that; the trainer keeps it (its behaviour logprobs are exact, so the
IS weight corrects it) unless told to drop it (--drop-stale). `max_staleness=0` is a synchronous
on-policy run from the same code.
"""

import asyncio
import contextvars
import inspect
import logging
import queue
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace

import aiohttp

from chat_format import ChatTemplate
from envs.confine import pin_to_rollout_cpus
from loss import group_advantages
from records import (
    RolloutCompletion,
    RolloutGroup,
    TaggedMessage,
    ToolCallRecord,
    TurnRecord,
    group_metrics,
)
from sampling import Sampling, request_seed
from vllm_server import doubling_wait

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# VLLM CLIENT: token ids in, token ids + behaviour logprobs out
# ---------------------------------------------------------------------------------------------------
class GenerationError(RuntimeError):
    """A request that cannot give a usable turn (retries exhausted, or tokens without logprobs)."""


class NoResponse(GenerationError):
    """No response came to judge: the server went away, timed out or kept failing past the retries,
    or none was in routing. A response the client refuses (no logprobs, HTTP 4xx) is the parent."""


# vLLM's OpenAI server sends a −inf logprob as −9999.0 (entrypoints/openai/completion/serving.py:
# `max(logprob, -9999.0)`, JSON has no −inf). For a top-N token it means outside the truncated set; for a
# token it sampled, that its logprobs are not of the distribution it sampled from.
VLLM_NEG_INF = -9999.0


@dataclass
class Generation:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top: list[dict[int, float]] | None = None  # per token, when asked (logprobs: N, token ids as keys)
    url: str = ""  # the server that generated it


@dataclass
class ClientStats:
    requests: int = 0
    retries: int = 0
    missing_logprobs: int = 0
    servers_down: int = 0  # times a server was taken out of routing (gone, or aborted our requests)
    servers_readmitted: int = 0


class VLLMClient:
    """aiohttp client over one or more vLLM servers, routing each request to the least-loaded one.

    A server that drops a connection and does not answer right after, or that aborts a request, is taken
    out of routing (`down`) and that request fails (its rollout restarts whole); later requests go to
    the others, or wait for one to come back. It comes back when it answers — and, with
    `expected_version`, only once it reports that weight version (`/weight_info`): a restarted server
    holds the base weights until the trainer has re-synced it, and must not serve the run before.
    """

    def __init__(
        self,
        urls: list[str],
        model: str | Callable[[], str],
        max_inflight: int = 64,
        request_timeout_s: float = 120.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        expected_version: Callable[[], object] | None = None,
    ):
        if not urls:
            raise ValueError("VLLMClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.inflight = dict.fromkeys(self.urls, 0)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.expected_version = expected_version
        self.down: set[str] = set()
        self.stats = ClientStats()
        self._max_inflight = max_inflight
        self._semaphore: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession | None = None
        self._next_probe: dict[str, float] = {}
        self._probes: set[asyncio.Task] = set()

    async def open(self) -> None:
        # Created inside the loop that uses them.
        self._semaphore = asyncio.Semaphore(self._max_inflight)
        # Idle pooled connections are dropped after 2 s, before the server's own keep-alive timeout
        # (uvicorn under vLLM: 5 s) closes them under a request we are sending.
        connector = aiohttp.TCPConnector(limit=self._max_inflight, keepalive_timeout=2.0)
        self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        for t in self._probes:
            t.cancel()
        if self._session is not None:
            await self._session.close()

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: dict) -> Generation:
        body = {
            "model": self.model() if callable(self.model) else self.model,  # LoRA: the version's adapter
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            **sampling,
        }
        async with self._semaphore:
            for attempt in range(self.max_retries + 1):
                url = await self._pick_server()
                self.inflight[url] += 1
                self.stats.requests += 1
                try:
                    data = await self._post(url, body)
                except _ServerGone as e:
                    if not e.aborted and attempt < self.max_retries and await self._answers(url):
                        # The same process with our weights: the connection was a pooled one the server
                        # had just closed (keep-alive race). Retry like any transient error.
                        self.stats.retries += 1
                        continue
                    # Gone (or it aborted our request): not retried here, since the rollout's earlier
                    # turns came from a process that is gone or from weights it aborted. The group
                    # restarts from scratch, so no sample mixes tokens from before and after.
                    self._take_down(url, e)
                    raise NoResponse(f"{url} went away mid-rollout: {e}") from e
                except (_NotServed, _Retryable) as e:
                    if self.expected_version is not None and not await self._answers(url):
                        # No longer holds the trainer's weights (taken out of the run by the per-sync
                        # check, or restarted): a request that reached it after its abort timed out. Or
                        # (404) no adapter of the trainer's version there (LoRA: its load failed in a
                        # sync, or it restarted while idle): kept in routing, its quick 404s drew every
                        # request to it.
                        self._take_down(url, e)
                        not_served = isinstance(e, _NotServed)
                        why = (
                            "does not serve the trainer's version" if not_served else "went away mid-rollout"
                        )
                        raise NoResponse(f"{url} {why}: {e}") from e
                    if isinstance(e, _NotServed):  # a version no longer loaded: its group restarts
                        raise
                    if attempt == self.max_retries:
                        raise NoResponse(f"{url}: gave up after {attempt + 1} attempts: {e}") from e
                    self.stats.retries += 1
                    # Exponential backoff with jitter, capped so a restarted server is found quickly.
                    await asyncio.sleep(min(8.0, self.backoff_s * 2**attempt) * (0.5 + random.random()))
                    continue
                finally:
                    self.inflight[url] -= 1
                return self._to_generation(
                    url, data, with_top=bool(sampling.get("return_tokens_as_token_ids"))
                )
        raise AssertionError("unreachable")

    def _take_down(self, url: str, why: Exception) -> None:
        if url not in self.down:
            self.down.add(url)
            self.stats.servers_down += 1
            logger.warning("vLLM server %s taken out of routing: %s", url, why)

    async def _pick_server(self) -> str:
        """The least-loaded server in routing; if none is, wait (probing) up to `request_timeout_s`."""
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            self._probe_down_servers()
            up = [u for u in self.urls if u not in self.down]
            if up:
                return min(up, key=self.inflight.__getitem__)
            if time.monotonic() > deadline:
                raise NoResponse(
                    f"no vLLM server for {self.request_timeout_s:.0f} s: {', '.join(sorted(self.down))} "
                    "down (not answering, or not yet holding the trainer's weights)"
                )
            await asyncio.sleep(0.2)

    def _probe_down_servers(self) -> None:
        now = time.monotonic()
        for url in list(self.down):
            if self._next_probe.get(url, 0.0) <= now:
                self._next_probe[url] = now + 1.0
                task = asyncio.get_running_loop().create_task(self._probe(url))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _answers(self, url: str) -> bool:
        """The server is up — and, with `expected_version`, reports that weight version."""
        path = "/health" if self.expected_version is None else "/weight_info"
        try:
            async with self._session.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200:
                    return False
                if self.expected_version is not None:
                    return (await r.json())["weight_version"] == str(self.expected_version())
                return True
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return False

    async def _probe(self, url: str) -> None:
        if await self._answers(url) and url in self.down:
            self.down.discard(url)
            self.stats.servers_readmitted += 1
            logger.warning("vLLM server %s back in routing", url)

    async def _post(self, url: str, body: dict) -> dict:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        try:
            async with self._session.post(f"{url}/v1/completions", json=body, timeout=timeout) as r:
                if r.status >= 500 or r.status in (408, 429):
                    raise _Retryable(f"HTTP {r.status}: {(await r.text())[:200]}")
                if r.status != 200:
                    error = _NotServed if r.status == 404 else GenerationError
                    raise error(f"{url}: HTTP {r.status}: {(await r.text())[:500]}")
                data = await r.json()
        except TimeoutError as e:  # before ClientConnectionError: aiohttp's timeouts subclass both
            raise _Retryable(f"{type(e).__name__}: no answer within {self.request_timeout_s:.0f} s") from e
        except aiohttp.ClientConnectionError as e:
            raise _ServerGone(f"{type(e).__name__}: {e}") from e
        except aiohttp.ClientPayloadError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from e
        choice = data["choices"][0]
        if choice.get("finish_reason") == "abort":  # the server aborted it: a failed weight sync, or shutdown
            raise _ServerGone("request aborted by the server", aborted=True)
        return choice

    def _to_generation(self, url: str, choice: dict, with_top: bool = False) -> Generation:
        ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logprobs is None or len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
            # Never re-tokenize text to recover ids: the whole group is aborted and re-queued instead.
            self.stats.missing_logprobs += 1
            raise GenerationError(f"{url}: response has token ids but no matching logprobs")
        if any(lp <= VLLM_NEG_INF for lp in logprobs):  # read as a number: a 1e4-nat IS ratio and mismatch
            self.stats.missing_logprobs += 1
            raise GenerationError(f"{url}: response gives a token it sampled the logprob −inf (−9999.0)")
        top = None
        if with_top:  # the fidelity probe's: "token_id:N" keys (return_tokens_as_token_ids)
            top_logprobs = choice["logprobs"].get("top_logprobs") or []
            top = [{int(k.rsplit(":", 1)[1]): float(v) for k, v in d.items()} for d in top_logprobs]
        return Generation(
            list(ids), [float(lp) for lp in logprobs], choice.get("finish_reason") or "stop", top, url
        )


class _Retryable(Exception):
    pass


class _NotServed(GenerationError):
    """404: the server does not serve the model (LoRA: the adapter) the request names."""


class _ServerGone(_Retryable):
    """The server dropped the connection or aborted the request: take it out of routing."""

    def __init__(self, message: str, aborted: bool = False):
        super().__init__(message)
        self.aborted = aborted


# ---------------------------------------------------------------------------------------------------
# THE MULTI-TURN TOOL LOOP (the default rollout function; an env may bring its own)
# ---------------------------------------------------------------------------------------------------
@dataclass
class RolloutContext:
    """Everything a rollout function needs besides the episode; shared by all rollouts of a worker."""

    client: VLLMClient
    template: ChatTemplate
    sampling: dict  # every field that shapes the distribution (sampling.Sampling.request_fields)
    max_turns: int
    max_context: int  # prompt + completion tokens, hard cap
    version: Callable[[], int]  # the trainer's current model version
    tool_semaphore: asyncio.Semaphore
    # (run seed, dataset stream position, completion index): each request is seeded with these and its
    # turn (sampling.request_seed); None = unseeded (greedy eval)
    seed_key: tuple[int, int, int] | None = None
    # Hermes: calls one assistant message may make (parallel calls, run concurrently); 1 = the turn ends
    # at its first `</tool_call>`, as single-call models are trained to do.
    max_calls_per_turn: int = 1


# A tool call's limit, waiting for a sandbox slot included (the sandbox's own limit, envs.retool's
# TOOL_TIMEOUT_S = 10 s, is well under it). Past it the call fails like any tool error: a researcher's tool
# blocked for good (a network call without a timeout) held its rollout, its group and the run until
# --batch-timeout. An env whose tools take longer sets rollout.TOOL_DEADLINE_S when it is imported.
TOOL_DEADLINE_S = 120.0


async def run_tool(
    tools: dict[str, Callable], name: str, args: dict | str, error: str | None
) -> ToolCallRecord:
    """Run one parsed call; every failure becomes a failed record whose result tells the model why.
    The result is Unicode text the tokenizer can encode: a lone surrogate (JSON's "\\ud800" in the
    model's arguments, echoed back by a tool or in an error) becomes "?" instead of failing the group."""
    t0 = time.monotonic()
    result, failed = await _call(tools, name, args, error)
    result = result.encode("utf-8", "replace").decode("utf-8")
    return ToolCallRecord(name, args, result, failed, time.monotonic() - t0)


async def _call(
    tools: dict[str, Callable], name: str, args: dict | str, error: str | None
) -> tuple[str, bool]:
    """run_tool's (result, failed)."""
    if error is None and name not in tools:
        error = f"unknown tool {name!r}; available: {', '.join(sorted(tools))}"
    if error is not None:
        return f"Error: {error}", True
    fn = tools[name]
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        return f"Error: bad arguments for {name}: {e}", True
    # An async tool is cancelled at the deadline (one that blocks the loop itself cannot be cut).
    deadline = asyncio.timeout(TOOL_DEADLINE_S)
    try:
        async with deadline:
            result = await (fn(**args) if inspect.iscoroutinefunction(fn) else _in_own_thread(fn, args))
    except (Exception, SystemExit) as e:  # a tool running code in-process meets sys.exit() too
        if deadline.expired():  # not a TimeoutError the tool raised itself (a socket timeout)
            return f"Error: {name} did not return within {TOOL_DEADLINE_S:g} s", True
        return f"Error: {name} raised {type(e).__name__}: {e}", True
    return str(result), False


def _in_own_thread(fn: Callable, args: dict) -> asyncio.Future:
    """`fn(**args)` in a daemon thread of its own, as a future of the running loop. Python cannot kill a
    thread: a sync tool past its deadline is left running, and its thread ends when the tool returns, or
    never. In the loop's default pool (asyncio.to_thread) such threads took its workers for good
    (min(32, CPUs + 4)), after which every to_thread (the rewards) and the client's name lookups waited
    behind them, and the interpreter's exit joined them; a daemon thread of its own does neither."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()  # as asyncio.to_thread does

    def target() -> None:
        try:
            outcome = (context.run(fn, **args), None)
        except (Exception, SystemExit) as e:
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the loop has closed: no one waits for it any more
            pass

    threading.Thread(target=target, name=f"tool {getattr(fn, '__name__', '?')}", daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile: the deadline passed, or the rollout was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def tool_loop_rollout(ctx: RolloutContext, episode, prompt_ids: list[int]) -> RolloutCompletion:
    """One completion: generate → parse tool calls → run tools → append their rendered ids → repeat."""
    comp = RolloutCompletion(prompt_len=len(prompt_ids), prompt_messages=list(episode.messages))
    tools = {t.__name__: t for t in episode.tools}
    is_done = getattr(episode, "is_done", None)
    ids = list(prompt_ids)
    tokenizer = ctx.template.tokenizer
    sampling = dict(ctx.sampling)
    if ctx.template.stop_token_ids:
        sampling["stop_token_ids"] = ctx.template.stop_token_ids + sampling.get("stop_token_ids", [])
    requests = 0
    for turn_index in range(ctx.max_turns):
        # One assistant message. Hermes with max_calls_per_turn > 1: a stop at `</tool_call>` is followed
        # by a request that continues the same message (prompt + generated so far), so the model can open
        # another call or end the turn; after the cap's last call the worker closes the turn.
        for call_index in range(ctx.max_calls_per_turn):
            budget = ctx.max_context - len(ids)
            if budget <= 0 and call_index == 0:
                comp.stop_reason = "context_budget"
                return comp
            if budget <= 0:
                break
            v_start, t0 = ctx.version(), time.monotonic()
            if ctx.seed_key is not None:
                sampling["seed"] = request_seed(*ctx.seed_key, requests)
            requests += 1
            gen = await ctx.client.generate(ids, budget, sampling)
            turn = TurnRecord(
                generated_ids=tuple(gen.ids),
                generated_logprobs=tuple(gen.logprobs),
                finish_reason=gen.finish_reason,
                model_versions=(v_start, ctx.version()),
                servers=(gen.url,),
                generation_s=time.monotonic() - t0,
                started_s=t0,
            )
            if call_index == 0:
                comp.add_turn(turn)
            else:
                comp.continue_turn(turn)
            ids += gen.ids
            stopped_at_call = gen.finish_reason == "stop" and gen.ids[-1:] == ctx.template.stop_token_ids
            if not (ctx.template.hermes and stopped_at_call):
                break
        last = comp.turns[-1]
        text = tokenizer.decode(last.generated_ids, skip_special_tokens=False)
        calls = (
            ctx.template.parse_tool_calls(text, last.generated_ids) if last.finish_reason != "length" else []
        )
        # The cap holds per message, not per request: a `</tool_call>` written as plain characters (not
        # the stop id) does not end a request, so one request can hold any number of calls (21 ran under
        # a cap of 1). Those past it are failed calls, each still answered by its tool message.
        cap = ctx.max_calls_per_turn
        calls[cap:] = [
            (n, a, e or f"more than {cap} tool call(s) in one message; not run") for n, a, e in calls[cap:]
        ]
        message = ctx.template.assistant_message(text, calls, last.generated_ids)
        comp.trajectory.append(TaggedMessage(message, generated=True))
        if last.finish_reason == "length":
            comp.stop_reason = "context_budget"
            return comp
        if not calls:
            comp.stop_reason = "eos"
            return comp
        if turn_index == ctx.max_turns - 1:
            comp.stop_reason = "max_turns"  # it still asks for a tool: truncated
            return comp
        t_tools = time.monotonic()
        async with ctx.tool_semaphore:
            records = await asyncio.gather(*(run_tool(tools, n, a, e) for n, a, e in calls))
        tool_messages = [{"role": "tool", "name": r.name, "content": r.result} for r in records]
        comp.trajectory.extend(TaggedMessage(m, generated=False) for m in tool_messages)
        response_ids = ctx.template.tool_response_ids(tool_messages, text)
        room = ctx.max_context - len(ids)
        comp.append_context(response_ids[:room], tuple(records), time.monotonic() - t_tools)
        ids += response_ids[:room]
        if len(response_ids) >= room:  # the tool output filled the context: nothing left to generate
            comp.stop_reason = "context_budget"
            return comp
        if is_done is not None and is_done():
            comp.stop_reason = "env_done"
            return comp
    comp.stop_reason = "max_turns"
    return comp


RolloutFn = Callable[[RolloutContext, object, list[int]], Awaitable[RolloutCompletion]]


def prompt_ids_with_room(template: ChatTemplate, messages: list[dict], max_context: int) -> list[int]:
    """The episode's prompt ids; ValueError (its group, or eval row, fails) when they leave no room for a
    completion in `max_context`."""
    prompt_ids = template.prompt_ids(messages)
    if len(prompt_ids) >= max_context:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_context={max_context}")
    return prompt_ids


def score(episode, completion: RolloutCompletion) -> float:
    """The episode's reward (run in a thread). A reward's sys.exit() fails the group as any error does:
    let through, asyncio ends the event loop with it, and a thread ended by SystemExit prints nothing."""
    try:
        return float(episode.reward(completion.messages, completion.tool_calls))
    except SystemExit as e:
        raise RuntimeError(f"reward raised SystemExit: {e}") from e


# ---------------------------------------------------------------------------------------------------
# THE WORKER: groups, admission by staleness, a bounded queue to the trainer
# ---------------------------------------------------------------------------------------------------
# The admission loop wakes when a group finishes, when the trainer bumps the version or discards a
# group, and at the latest after this long (for the in-flight accounting: `request_seconds`).
ADMISSION_BACKSTOP_S = 0.1
# A dropped group holds its admission slot 0.1 s · 2^(groups dropped in a row before it), at most 30 s,
# before the next row may start. A fault that fails every request at once (HTTP 400 for every prompt, a
# server without token ids) otherwise cycled through ~100 rows a second until --batch-timeout, three
# warnings each, every row counted as used in the checkpoint. Retries of one group do not wait (a server
# that went away is waited for in VLLMClient), so recovery from an outage is as fast as before.
GROUP_BACKOFF_S, GROUP_BACKOFF_MAX_S = 0.1, 30.0


@dataclass
class WorkerStats:
    groups_started: int = 0
    groups_done: int = 0
    groups_retried: int = 0
    groups_failed: int = 0
    failed_rows: list[int] = field(default_factory=list)  # stream indices of the failed groups (resume)
    groups_discarded: int = 0  # reported back by the trainer (stale or zero-variance)
    request_seconds: float = 0.0  # ∫ requests in flight dt; its change over a span / the span = mean
    last_error: str = ""
    errors: list[str] = field(default_factory=list)


class AsyncRolloutWorker:
    """Generates scored `RolloutGroup`s into `self.queue` from a daemon thread running an asyncio loop.

    The trainer calls `set_version(v)` after each weight sync and `discard(n)` for groups it threw away,
    so that replacements are admitted; `stop()` returns within `timeout_s` whatever the servers do.
    """

    def __init__(
        self,
        client: VLLMClient,
        template: ChatTemplate,
        make_episode: Callable[[dict], object],
        rows: Iterator[dict],
        *,
        num_generations: int,
        groups_per_version: int,
        max_staleness: int = 1,
        max_turns: int = 4,
        max_calls_per_turn: int = 1,
        max_context: int = 1024,
        sampling: dict | None = None,
        seed: int | None = None,
        max_concurrent_tools: int = 16,
        group_retries: int = 2,
        scale_rewards: bool = True,
        rollout_fn: RolloutFn | None = None,
        queue_size: int | None = None,
        start_version: int = 0,
    ):
        self.client = client
        self.template = template
        self.make_episode = make_episode
        self.rows = rows
        self.num_generations = num_generations
        self.groups_per_version = groups_per_version
        self.max_staleness = max_staleness
        self.max_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.max_context = max_context
        # Unset fields are pinned to the neutral ones the trainer scores with (never the server's defaults).
        self.sampling = {**Sampling().request_fields(), **(sampling or {})}
        self.seed = seed  # per-request seeds from it (sampling.request_seed); None = unseeded
        self.max_concurrent_tools = max_concurrent_tools
        self.group_retries = group_retries
        self.scale_rewards = scale_rewards
        self.rollout_fn = rollout_fn or tool_loop_rollout
        # Admission already bounds what exists; the queue bound makes that a hard memory bound too.
        self.queue: queue.Queue[RolloutGroup] = queue.Queue(
            queue_size or groups_per_version * (max_staleness + 1)
        )
        self.stats = WorkerStats()
        self.version = start_version  # the trainer's model version; a resumed run starts above 0
        self._start_version = start_version  # admission counts groups from here
        self._stopping = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_thread, name="rollout-worker", daemon=True)
        self._main: asyncio.Task | None = None
        self._wake = asyncio.Event()  # set from the trainer's thread (through the loop), read by the loop
        self._rows_exhausted = False
        self._dropped_in_row = 0  # groups dropped since the last one delivered (GROUP_BACKOFF_S)

    # --- called from the trainer thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def set_version(self, version: int) -> None:
        if version != self.version:
            self.version = version
            self._nudge()

    def discard(self, n: int = 1) -> None:
        self.stats.groups_discarded += n
        self._nudge()

    def _nudge(self) -> None:
        """Wake the admission loop now: a version bump or a discard frees admission, and waiting for the
        loop's next wake (a group finishing, or ADMISSION_BACKSTOP_S) held the version's new groups back
        by up to the backstop, against a trainer step of 0.3-0.5 s on the CPU bench."""
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: nothing left to admit
            pass

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def exhausted(self) -> bool:
        """All rows were used and every group has been delivered or dropped."""
        return (
            self._rows_exhausted
            and self.stats.groups_started == self.stats.groups_done + self.stats.groups_failed
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop admitting, cancel every in-flight request and tool, close HTTP, join the thread."""
        self._stopping.set()
        if self._thread.is_alive() and self._main is not None:
            self._loop.call_soon_threadsafe(self._main.cancel)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error(
                "rollout thread still alive %.1f s after stop(); it is a daemon and dies with us", timeout_s
            )

    # --- the loop thread --------------------------------------------------------------------------------
    def _run_thread(self) -> None:
        # Before any thread or process is started from here (to_thread's pool, sandbox processes):
        # they inherit this thread's CPUs, not the trainer's.
        pin_to_rollout_cpus()
        asyncio.set_event_loop(self._loop)
        self._main = self._loop.create_task(self._main_loop())
        try:
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("rollout worker crashed")
        finally:
            self._loop.run_until_complete(self.client.close())
            self._loop.close()

    def _admissible(self) -> bool:
        live = self.stats.groups_started - self.stats.groups_failed - self.stats.groups_discarded
        versions = self.version - self._start_version + 1 + self.max_staleness
        return live < versions * self.groups_per_version

    async def _main_loop(self) -> None:
        await self.client.open()
        self._ctx = RolloutContext(
            client=self.client,
            template=self.template,
            sampling=self.sampling,
            max_turns=self.max_turns,
            max_context=self.max_context,
            max_calls_per_turn=self.max_calls_per_turn,
            version=lambda: self.version,
            tool_semaphore=asyncio.Semaphore(self.max_concurrent_tools),
        )
        tasks: set[asyncio.Task] = set()
        t_last = time.monotonic()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()  # this loop wakes at least every ADMISSION_BACKSTOP_S
                self.stats.request_seconds += sum(self.client.inflight.values()) * (now - t_last)
                t_last = now
                while not self._rows_exhausted and self._admissible():
                    try:
                        row = next(self.rows)
                    except StopIteration:
                        self._rows_exhausted = True
                        break
                    # row_stream gives each row its stream position; any other iterator, the admission count
                    row = {"_index": self.stats.groups_started, **row}
                    self.stats.groups_started += 1
                    tasks.add(asyncio.create_task(self._group(row, self.version)))
                self._wake.clear()  # admission above saw every version and discard set before this
                woken = asyncio.ensure_future(self._wake.wait())
                try:
                    done, _ = await asyncio.wait(
                        {*tasks, woken}, timeout=ADMISSION_BACKSTOP_S, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    woken.cancel()
                done.discard(woken)
                tasks -= done
                for task in done:
                    group = task.result()
                    if group is None:
                        continue
                    while not self._stopping.is_set():
                        try:
                            self.queue.put_nowait(group)  # a thread-safe queue: poll, never block the loop
                            # counted once queued, so `exhausted` never claims a group still on its way
                            self.stats.groups_done += 1
                            break
                        except queue.Full:
                            await asyncio.sleep(0.02)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _group(self, row: dict, admitted_version: int) -> RolloutGroup | None:
        """Generate and score one group; a failure retries the whole group from fresh episodes (no state
        from the failed attempt survives), then drops it with a counted warning — never kills the worker."""
        for attempt in range(self.group_retries + 1):
            try:
                group = await self._attempt_group(row, admitted_version)
                self._dropped_in_row = 0
                return group
            except asyncio.CancelledError:
                raise
            except Exception as e:
                while isinstance(e, ExceptionGroup):  # TaskGroup wraps the failing rollout's error
                    e = e.exceptions[0]
                if self._stopping.is_set():
                    # stop() cancelled us, but Python 3.11's TaskGroup can swallow a cancel that lands
                    # while it is cancelling a failed rollout's siblings: never start another attempt.
                    return None
                msg = f"{type(e).__name__}: {e}"
                self.stats.last_error = msg
                self.stats.errors = (self.stats.errors + [msg])[-20:]
                if attempt < self.group_retries:
                    self.stats.groups_retried += 1
                    logger.warning("group failed (attempt %d), retrying: %s", attempt + 1, msg)
        # Counted failed (which frees the slot) only after the wait; cancelled by stop() meanwhile, the
        # row is not counted used, and a resume generates it again.
        backoff_s = doubling_wait(GROUP_BACKOFF_S, GROUP_BACKOFF_MAX_S, self._dropped_in_row)
        self._dropped_in_row += 1
        await asyncio.sleep(backoff_s)
        self.stats.groups_failed += 1
        self.stats.failed_rows.append(row["_index"])
        logger.warning("group dropped after %d attempts: %s", self.group_retries + 1, self.stats.last_error)
        return None

    async def _attempt_group(self, row: dict, admitted_version: int) -> RolloutGroup:
        episodes = [self.make_episode(row) for _ in range(self.num_generations)]
        prompt_ids = prompt_ids_with_room(self.template, episodes[0].messages, self.max_context)
        t0 = time.monotonic()
        rollout = getattr(episodes[0], "rollout", None) or self.rollout_fn
        ctxs = [self._ctx] * len(episodes)
        if self.seed is not None:  # seeds keyed by the row's stream position and the completion index
            ctxs = [replace(self._ctx, seed_key=(self.seed, row["_index"], i)) for i in range(len(ctxs))]
        async with asyncio.TaskGroup() as tg:  # one failure cancels its siblings
            tasks = [tg.create_task(rollout(ctx, ep, prompt_ids)) for ctx, ep in zip(ctxs, episodes)]
        completions = [t.result() for t in tasks]
        # Rewards may be slow (math-verify, bounded by envs.verify.DEADLINE_S each) and must not stall
        # other groups' requests; in threads, so the verify pool checks them side by side.
        rewards = await asyncio.gather(
            *(asyncio.to_thread(score, ep, c) for ep, c in zip(episodes, completions, strict=True))
        )
        for c, r in zip(completions, rewards, strict=True):
            c.reward = r
        advantages = group_advantages(rewards, scale_by_std=self.scale_rewards).tolist()
        metrics = group_metrics(completions)
        metrics["rollout/group_s"] = time.monotonic() - t0
        metrics["rollout/reward_timeouts"] = float(sum(getattr(ep, "reward_timeouts", 0) for ep in episodes))
        return RolloutGroup(
            prompt_messages=list(episodes[0].messages),
            prompt_ids=prompt_ids,
            row=row,
            completions=completions,
            rewards=rewards,
            advantages=advantages,
            admitted_version=admitted_version,
            metrics=metrics,
        )
