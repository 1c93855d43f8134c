"""Push the trainer's weights into running vLLM servers, over NCCL on GPU and gloo on CPU.

    syncer = WeightSyncer([s.url for s in servers], backend="gloo")   # "nccl" on GPU
    syncer.init()                                   # once: the server workers join the trainer
    metrics = syncer.sync(model.named_parameters(), version=step)
    for url in syncer.out_of_step():                # restarted, or failed a sync: bring it back
        syncer.join([url]); syncer.sync(model.named_parameters(), version=step, urls=[url])
    syncer.close()

One protocol for both transports: vLLM's own HTTP routes (`VLLM_SERVER_DEV_MODE=1`),
`/init_weight_transfer_engine` once, then per sync: pause (`/sleep?level=0&mode=keep`) -> drop the KV
cache (`/reset_prefix_cache?reset_running_requests=true`) -> `/start_weight_update` -> `/update_weights`
(while the trainer broadcasts) -> `/finish_weight_update` (which sets the version tag) -> resume
(`/wake_up?tags=scheduling`): six round trips a sync, none per tensor or bucket.

`/update_weights` blocks inside the server until its workers have received every tensor, so it runs
on a thread while the trainer broadcasts. The trainer is rank 0. gloo: one group per server (its
workers at ranks 1..), each piece posted to all groups at once, so a dead server breaks only its own
group. nccl: one group over every worker of every server (server i's workers after those of servers
0..i-1), as vLLM's own trainer engine does.

GPU: the workers run vLLM's `nccl` engine and the trainer uses vLLM's own NCCL helpers (rendezvous
and packed producer), so both sides are vLLM's code. CPU: vLLM ships no CPU engine, so
`weight_sync_server.py` registers a `gloo` one, imported into every worker by `--worker-extension-cls`
(vllm_server.py). The gloo engine mirrors the NCCL one: the same update payload (names, dtypes,
shapes), the same layerwise reload. Tensors travel as pieces cut identically on both sides from that
payload (`plan_buckets` with `PIECE_BYTES`): a tensor over 1 MiB alone, sent from its own memory (no
copy when it is contiguous and already in the send dtype), runs of smaller ones together. Both sides
keep up to `bucket_bytes` of pieces posted ahead, so the worker receives the next pieces (on gloo's
threads, on a core vLLM's compute threads are not pinned to) while `load_weights` loads this one, into
receive buffers kept between syncs.

Never hang: every HTTP call and every collective has a timeout (the NCCL send, which has none, runs
on a thread we stop waiting for). A server that fails (dead, erroring, silent) is dropped from the
rest of the sync; the others complete it and are resumed; then `WeightSyncError` names each failed
server and its phase. The syncer carries on with the survivors; a failed server comes back through
`out_of_step` → `join` → `sync(..., urls=...)` once it answers again (restarted or not): the servers'
weight-version tag (`/weight_info`, "default" on a fresh server) tells which ones hold our weights.
`rejoin` (heal's) joins such a server once, and tries one that cannot join at doubling waits
(`JOIN_RETRY_S`); a server that answers its join request with an error ends the trainer's wait at once.

Departures from vLLM's own trainer engine (`NCCLTrainerWeightTransferEngine`): several independent
servers (one gloo group each), pause/resume and the version bump done here, timeouts on everything, and on
CPU the tied lm_head re-packed after each sync (weight_sync_server.py).
"""

import datetime
import json
import math
import queue
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from vllm_server import doubling_wait, healthy, is_loopback, route_source

# nccl: the size of each of vLLM's two packed buffers. gloo: the most bytes either side posts ahead of the
# piece being sent or loaded (so the receive of the next pieces overlaps the load of this one).
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# A server that answers but cannot join (or fails the sync right after) is tried again after the first
# wait, then at doubling waits up to the longest: not at every heal (every 5 s while the trainer waits).
JOIN_RETRY_S = (10.0, 120.0)
# gloo: consecutive tensors smaller than this travel as one piece (one broadcast, one small copy); a
# larger tensor travels alone, straight from its own memory.
PIECE_BYTES = 1024 * 1024


class WeightSyncError(RuntimeError):
    """A sync (or the group set-up) failed; the message names the server(s) and the phase."""


class JoinRefused(RuntimeError):
    """A server answered its join request with an error: it will not dial the group."""

    def __init__(self, url: str, error: BaseException):
        super().__init__(f"{url} refused to join: {type(error).__name__}: {str(error)[:500]}")
        self.url = url


# ---------------------------------------------------------------------------------------------------
# TRANSPORT HELPERS (shared with the gloo worker engine: weight_sync_server.py)
# ---------------------------------------------------------------------------------------------------


def gloo_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[dist.TCPStore, dist.ProcessGroupGloo]:
    """Join a gloo group through a TCPStore that rank 0 hosts; blocks until all ranks have joined. No
    global `init_process_group`: the trainer (FSDP) and the vLLM worker have their own default groups,
    so this one stands alone. The store must outlive the group: keep both."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    # Gloo's default device is the address the hostname resolves to, which on another host (or in a
    # network namespace) may be one the peers cannot reach: bind to our end of the route to the store.
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=route_source(host))]
    return store, dist.ProcessGroupGloo(store, rank, world_size, options)


def default_sync_host(urls: list[str]) -> str:
    """The rendezvous address the servers dial to join the transfer groups: this host's end of the
    route to the first server on another host; 127.0.0.1 when every server is local (one route is
    assumed to serve them all: pass --sync-host where it does not). Raises ValueError, one line."""
    for url in urls:
        host = urllib.parse.urlparse(url).hostname or ""
        if not is_loopback(host):
            return route_source(host)
    return "127.0.0.1"


def plan_buckets(shapes: list[list[int]], dtypes: list[torch.dtype], bucket_bytes: int) -> list[list[int]]:
    """Cut the parameter list into consecutive buckets of at most `bucket_bytes` (a larger tensor goes
    alone). Sender and receivers run this on the same metadata, so they cut identically."""
    buckets: list[list[int]] = []
    size = 0
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        nbytes = math.prod(shape) * dtype.itemsize
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _to_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------------------
# TRAINER SIDE
# ---------------------------------------------------------------------------------------------------


class HTTPStatusError(RuntimeError):
    """A server's non-2xx answer: its `status` and its own `text`."""

    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:1000]}")
        self.status, self.text = status, text


def post(url: str, path: str, body: dict | None, timeout_s: float) -> dict:
    """POST JSON; HTTPStatusError with the server's own error text on a non-2xx answer (OSError when
    none comes). An answer that is not JSON (vLLM's LoRA routes answer plain text) is {"text": …}."""
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        raise HTTPStatusError(e.code, e.read().decode(errors="replace")) from None
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {"text": text}


def _reset_kv(url: str, path: str, body: dict | None, timeout_s: float) -> dict:
    answer = post(url, path, body, timeout_s)
    if not answer.get("success"):  # blocks still held (vLLM: a remote KV transfer in flight)
        raise RuntimeError(f"vLLM did not reset its KV cache: {answer}")
    return answer


def _resume(url: str, path: str, body: dict | None, timeout_s: float) -> dict:
    answer = post(url, path, body, timeout_s)
    if answer.get("status") != "awake":  # still asleep at another level (a shared server put to sleep)
        raise RuntimeError(f"vLLM did not wake up: {answer}")
    return answer


def weight_tags(urls: list[str], timeout_s: float = 2.0) -> dict[str, str | None]:
    """Each server's weight-version tag (`/weight_info`; "default" on a fresh server), asked of all at
    once: a busy server answers after its current engine step. None for one that does not answer."""

    def tag(url: str) -> str | None:
        try:
            with urllib.request.urlopen(url + "/weight_info", timeout=timeout_s) as r:
                return json.loads(r.read())["weight_version"]
        except Exception:  # noqa: BLE001 - not answering (yet)
            return None

    pool = ThreadPoolExecutor(max_workers=max(1, len(urls)))
    futures = [pool.submit(tag, u) for u in urls]
    pool.shutdown(wait=False)
    late = _collect(urls, futures, timeout_s)  # `tag` raises nothing: these are the backstop's timeouts
    return {u: None if u in late else f.result() for u, f in zip(urls, futures)}


def _call_all(
    urls: list[str], path: str, bodies: list[dict | None], timeout_s: float, call=post
) -> dict[str, str]:
    """The same call on every server at once. Returns {url: error} for the servers that failed."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(urls)))
    futures = [pool.submit(call, u, path, b, timeout_s) for u, b in zip(urls, bodies)]
    pool.shutdown(wait=False)  # never join a thread stuck on a dead server
    return _collect(urls, futures, timeout_s)


def _collect(urls: list[str], futures: list, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s + 5  # urllib's own timeout fires first; this is a backstop
    errors = {}
    for u, f in zip(urls, futures):
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            errors[u] = f"no answer within {timeout_s:.0f} s"
        except Exception as e:  # noqa: BLE001 - reported with the server's name
            errors[u] = f"{type(e).__name__}: {e}"
    return errors


_DONE = object()


# THE HAND-OFF (GPU): a tensor drawn on the feeding thread (an FSDP gather, the cast to the send dtype) is
# only queued on that thread's current stream when it is handed over; the sending thread reads it on
# another stream (vLLM's producer packs on side streams of its own), and threads do not order streams. So
# each tensor travels with a CUDA event recorded on the stream that produced it (`_produced`); the thread
# that takes it makes its current stream (the one that reads it: vLLM's pack) wait on that event, and
# `record_stream`s the tensor on it so the caching allocator does not give its memory to the next cast
# before that stream has read it (`_taken`). No host synchronize: the next gathers overlap these sends.
def _produced(t: torch.Tensor) -> "torch.cuda.Event | None":
    if not t.is_cuda:
        return None  # CPU tensors (gloo) are ready when drawn
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


def _taken(feed: queue.Queue) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t, event in iter(feed.get, _DONE):
        if event is not None:
            reader = torch.cuda.current_stream(t.device)  # the consumer's, when it takes the tensor
            reader.wait_event(event)
            t.record_stream(reader)
        yield name, t


def _feed(consume, items: Iterator[tuple[str, torch.Tensor]], timeout_s: float, what: str) -> None:
    """Run `consume(iterator)` on a daemon thread (an NCCL send, which has no timeout of its own) and
    feed it the (name, tensor) `items` from this thread through a bounded queue, each stream-ordered as
    said above. Every item is drawn here, whatever becomes of the consumer: drawing one is an FSDP
    gather, a collective the other ranks make too, so a send that stops (a peer died mid-broadcast)
    never leaves them waiting on gathers rank 0 did not make. Items the consumer does not take by the
    deadline are dropped; then TimeoutError (or the consumer's own error) is raised. A stuck thread is
    left behind (destroying its communicator ends it)."""
    feed: queue.Queue = queue.Queue(maxsize=2)
    result: dict = {}

    def target() -> None:
        try:
            consume(_taken(feed))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    taking = True  # the consumer is alive and within the deadline
    for item in _then_done(items):
        handed = item if item is _DONE else (*item, _produced(item[1]))  # the event right after the draw
        while taking:
            try:
                feed.put(handed, timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                break
            except queue.Full:
                taking = thread.is_alive() and time.monotonic() < deadline
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]


def _then_done(items: Iterator) -> Iterator:
    yield from items
    yield _DONE


def _on_daemon_thread(fn, *args) -> Future:
    """`fn(*args)` on a daemon thread: a rendezvous left to its timeout (`_await_join`) must not hold up
    the process's exit, as a ThreadPoolExecutor's thread would."""
    future: Future = Future()

    def target() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - the caller's to read
            future.set_exception(e)

    threading.Thread(target=target, daemon=True, name=f"weight-sync {fn.__name__}").start()
    return future


class WeightSyncer:
    """Trainer-side client: owns the transfer group(s) with the server workers, and the version.

    gloo: posting each piece to every server's group at once costs what one gloo broadcast to all
    would (it sends one copy per peer either way). nccl: the one group means a failure there fails the
    sync for every server, a sync always goes to every member (`urls` is widened: a collective over a
    server outside the sync would hang), and a member that fails before the broadcast fails the sync
    with no collective at all.

    `rank` is the trainer rank under FSDP: only rank 0 talks to the servers and broadcasts; the other
    ranks call `sync` too, so the `full_tensor()` gathers (collectives) stay in step.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        backend: str = "gloo",
        master_address: str | None = None,
        http_timeout_s: float = 60.0,
        transfer_timeout_s: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        send_dtype: torch.dtype | None = None,
        rank: int = 0,
        startup_timeout_s: float = 600.0,
    ):
        assert backend in ("gloo", "nccl"), backend
        self.urls = [u.rstrip("/") for u in urls]  # every server of the run, in step or not
        self.backend = backend
        # The address of this host the servers dial to join (default_sync_host when not given).
        try:
            self.master_address = master_address or default_sync_host(self.urls)
        except ValueError as e:
            raise WeightSyncError(f"no rendezvous address for the servers ({e}): pass --sync-host") from None
        self.http_timeout_s = http_timeout_s  # pause/reset/start/finish/resume, each call
        self.transfer_timeout_s = transfer_timeout_s  # group join, /update_weights, each piece
        self.bucket_bytes = bucket_bytes
        self.send_dtype = send_dtype  # e.g. torch.bfloat16 halves the bytes for a bf16 server
        self.rank = rank
        self.version: int | None = None  # of the trainer's weights at the last sync, got or not
        self.groups: dict[str, object] = {}  # url -> gloo ProcessGroup; nccl: every url -> one communicator
        self.failed: dict[str, str] = {}  # url -> why its last sync failed (out of step until re-synced)
        # Servers of an NCCL broadcast that timed out: they answer /health but wait in vLLM's packed
        # consumer (no timeout) for the rest of it, so only a restart frees them (`relaunch_exited`'s
        # `stuck`; --vllm-url: whoever runs them). Not re-joined until they report a fresh start.
        self.stuck: set[str] = set()
        # Stuck servers restarted (`to_restart`) and not yet answering as fresh: url -> the monotonic time
        # after which a start-up that never answered is tried again. Left out of joins meanwhile.
        self.restarting: dict[str, float] = {}
        self.startup_timeout_s = startup_timeout_s
        self.taken_out: dict[str, str] = {}  # url -> why it left the run (`take_out`); not in `urls`
        self.stores: dict = {}  # gloo group -> its TCPStore, which must outlive it
        self.phase_seconds: dict[str, float] = {}  # the last sync's, by phase (bench_weight_sync.py)
        self._tags_ahead: tuple | None = None  # (version when asked, Future of weight_tags): poll_ahead
        # Servers `rejoin` joined that still wait for the weights (the next sync, or heal's push): their tag
        # stays "default" until then, and they are not joined again meanwhile (each join is a new group).
        self.awaiting: set[str] = set()
        # url -> (monotonic time of its next try, its tries so far) for the servers `rejoin` tried that
        # no sync has reached since (the join or the push failed): backed off (JOIN_RETRY_S).
        self.retry: dict[str, tuple[float, int]] = {}
        self.join_retry_s = JOIN_RETRY_S
        self.join_failing: set[str] = set()  # failing to come back since a sync last reached them: named once

    def init(self) -> None:
        """Form the transfer group(s) with every server. Raises naming any server that fails."""
        self.join(self.urls)

    def join(self, urls: list[str]) -> None:
        """Ask the servers `urls` to join while the trainer joins as rank 0 (both sides block until the
        group is complete, so the HTTP calls run on threads). A server already joined gets a new group
        (the old one may be out of step). nccl has one group for all: it is re-formed with every server
        that answers. Every server is probed first, so a dead one costs the others nothing: they join,
        then `WeightSyncError` names the dead one."""
        if self.rank != 0:
            return
        from vllm_server import free_port

        if self.backend == "nccl":
            urls = self.urls
        # A stuck server waits inside the receive and a restarting one is not up: both still answer (or
        # will) /get_world_size, and a group formed with them waits for them to its timeout.
        self._release([u for u in urls if u in self.stuck or u in self.restarting])
        urls = [u for u in urls if u not in self.stuck and u not in self.restarting]
        # A failed server may hold an update our side gave up on but its side began (/start_weight_update
        # timed out here, completed there): every later /start_weight_update would fail "already active".
        failed = [u for u in urls if u in self.failed]
        _call_all(failed, "/finish_weight_update", [None] * len(failed), self.http_timeout_s)  # errors: none
        sizes, dead = {}, {}
        for u in urls:
            try:
                with urllib.request.urlopen(u + "/get_world_size", timeout=self.http_timeout_s) as r:
                    sizes[u] = int(json.loads(r.read())["world_size"])
            except Exception as e:  # noqa: BLE001 - named in the error below, after the others joined
                dead[u] = f"did not answer /get_world_size: {e}"
        self._release(urls)  # their groups are replaced (or, for the dead ones, gone)
        urls = [u for u in urls if u in sizes]
        if urls:
            self._form_groups(urls, sizes, free_port)
        if dead:
            detail = "; ".join(f"{u} {m}" for u, m in dead.items())
            raise WeightSyncError(f"init: {detail} (joined: {', '.join(urls) or 'none'})")

    def _release(self, urls: list[str]) -> None:
        """Drop our end of the groups of `urls`. A communicator no other server still uses is destroyed:
        NCCL's holds GPU memory and may hold a kernel a failed broadcast left queued (ncclCommAbort ends
        it); a gloo group goes with its store (sockets, a thread)."""
        old = [g for u in urls if (g := self.groups.pop(u, None)) is not None]
        in_use = {id(g) for g in self.groups.values()}
        self._release_groups({id(g): g for g in old if id(g) not in in_use}.values())

    def _release_groups(self, groups) -> None:
        for g in groups:
            self.stores.pop(g, None)
            if hasattr(g, "destroy"):  # vLLM's PyNcclCommunicator
                g.destroy()

    def _form_groups(self, urls: list[str], sizes: dict[str, int], free_port) -> None:
        if self.backend == "nccl":
            port, world = free_port(), 1 + sum(sizes.values())
            offsets = [1 + sum(sizes[v] for v in urls[:i]) for i in range(len(urls))]
            bodies = [{"init_info": self._worker_init_info(port, off, world)} for off in offsets]
            joins = [(urls, port, world)]
        else:
            ports = [free_port() for _ in urls]
            bodies = [{"init_info": self._worker_init_info(p, 1, 1 + sizes[u])} for u, p in zip(urls, ports)]
            joins = [([u], p, 1 + sizes[u]) for u, p in zip(urls, ports)]
        # A server's engine replaces its communicator on init without destroying it (vLLM 0.32's NCCL
        # engine): release it first. A server with none (fresh, restarted) answers the same; one that
        # refuses (mid-update) is told to join anyway.
        _call_all(urls, "/shutdown_weight_transfer_engine", [None] * len(urls), self.http_timeout_s)
        pool = ThreadPoolExecutor(max_workers=len(urls))
        futures = [pool.submit(post, u, "/init_weight_transfer_engine", b, self.transfer_timeout_s)
                   for u, b in zip(urls, bodies)]  # fmt: skip
        pool.shutdown(wait=False)
        # Joined side by side (gloo: one group per server), so one server that cannot join neither costs
        # the others their group nor leaves the groups formed before it holding a store (sockets, threads).
        attempts = [(*join, _on_daemon_thread(self._join, *join[1:])) for join in joins]
        joined, failed = {}, {}
        for members, port, world, attempt in attempts:
            try:
                posts = {u: futures[urls.index(u)] for u in members}
                group = self._await_join(attempt, posts, port, world)
                joined.update({u: group for u in members})
            except Exception as e:  # noqa: BLE001 - named below, after the others joined
                failed.update({u: (port, e) for u in members})
        errors = _collect(urls, futures, 5 if failed else self.transfer_timeout_s)
        if errors and self.backend == "nccl":  # one communicator spans them all: none of them keeps it
            self._release_groups(set(joined.values()))
            joined = {}
        for u in [u for u in joined if u in errors]:
            self._release_groups({joined.pop(u)})
        self.groups.update(joined)
        if failed:
            e = next(iter(failed.values()))[1]
            detail = "; ".join(
                f"{u} was told to dial {self.master_address}:{port}"
                + (f" and reported {errors[u]}" if u in errors else "")
                for u, (port, _) in failed.items()
            )
            # A server that answered with an error ended the wait: no timeout was waited out.
            answered = all(isinstance(why, JoinRefused) for _, why in failed.values())
            raise WeightSyncError(
                f"init: the servers did not join the {self.backend} transfer group(s)"
                + ("" if answered else f" within {self.transfer_timeout_s:.0f} s")
                + f": {detail} (joined: {', '.join(joined) or 'none'}). Can "
                f"they reach {self.master_address}? If not, pass --sync-host with an address of this host "
                f"they can reach. (Trainer side: {type(e).__name__}: {str(e)[:300]})"
            ) from e
        if errors:
            raise WeightSyncError("init failed: " + "; ".join(f"{u}: {m}" for u, m in errors.items()))

    def _await_join(self, attempt: Future, posts: dict[str, Future], port: int, world_size: int):
        """The group `attempt` forms (the trainer's end of the rendezvous), or JoinRefused as soon as one
        of its servers answers its join request (`posts`) with an HTTP error: it will never dial, and the
        rendezvous would wait for it to the transfer timeout. torch cannot cut a rendezvous short (a
        TCPStore has no abort; a group has no handle until it is built), so `_stand_in` dials it in the
        refusing server's place (gloo), and whatever the attempt builds is released."""
        pending: set[Future] = {attempt, *posts.values()}
        deadline = time.monotonic() + self.transfer_timeout_s + 5  # the rendezvous' own timeout first
        while attempt in pending:
            done, pending = wait(pending, max(0.0, deadline - time.monotonic()), FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"the rendezvous did not end within {self.transfer_timeout_s:.0f} s")
            for u, post_done in posts.items():
                # An answer only: a request that timed out leaves a server still at it (the rendezvous
                # times out with it).
                refusal = post_done.exception() if post_done in done else None
                if isinstance(refusal, HTTPStatusError) and not attempt.done():
                    attempt.add_done_callback(self._release_late)
                    self._stand_in(port, world_size)
                    raise JoinRefused(u, refusal)
        return attempt.result()

    def _stand_in(self, port: int, world_size: int) -> None:
        """Dial a refused rendezvous as the ranks that will never come, so the trainer's end forms now and
        is released. Left to its timeout, it wakes on its daemon thread, and if the process is exiting by
        then CPython ends that thread inside torch's C++: the process aborts ("terminate called without
        an active exception", exit 134). gloo only: one group a server, so every rank but 0 is the
        refusing server's. nccl's one communicator would need GPU ranks: its attempt ends at its
        timeout."""
        if self.backend == "gloo":
            for rank in range(1, world_size):
                _on_daemon_thread(
                    gloo_group, self.master_address, port, rank, world_size, self.transfer_timeout_s
                )

    def _release_late(self, attempt: Future) -> None:
        if attempt.exception() is None:  # a group formed after all: nobody holds it
            self._release_groups({attempt.result()})

    def reached(self, url: str) -> None:
        """A sync reached `url`: what failing, `rejoin` and heal noted of it goes (left, its next restart
        would not be joined again, `awaiting`, or would wait out the last back-off, `retry`)."""
        self.failed.pop(url, None)
        self.retry.pop(url, None)
        self.awaiting.discard(url)
        self.join_failing.discard(url)

    def out_of_step(self) -> list[str]:
        """Servers that answer but may not hold the trainer's weights: restarted (a new server reports
        weight version "default" and has no group), or failed their last sync. Dead ones are left out:
        there is nothing to do for them until they answer."""
        ahead, self._tags_ahead = self._tags_ahead, None
        # Answers asked before a sync would name every server that took it as out of step: asked again.
        tags = ahead[1].result() if ahead is not None and ahead[0] == self.version else None
        tags = tags or weight_tags(self.urls)
        stale = []
        for u in self.urls:
            tag = tags.get(u)
            if tag is None:
                continue
            if (u in self.stuck or u in self.restarting) and tag != "default":
                continue  # still inside the receive (or its restart not up yet): a join would wait in vain
            self.stuck.discard(u)
            self.restarting.pop(u, None)
            if u not in self.groups or u in self.failed or tag != str(self.version):
                stale.append(u)
        return stale

    def poll_ahead(self) -> None:
        """Ask every server for its weight tag now, on a thread, for the next `out_of_step` (heal's, before
        each sync): each answer waits for a busy server's engine step, which then runs beside the
        trainer's step instead of before its sync. A sync before that `out_of_step` voids the answers."""
        if self._tags_ahead is None:
            pool = ThreadPoolExecutor(max_workers=1)
            self._tags_ahead = (self.version, pool.submit(weight_tags, list(self.urls)))
            pool.shutdown(wait=False)

    def to_restart(self) -> list[str]:
        """Stuck servers to restart now (`vllm_server.relaunch_exited`): each once, then again only if it
        has not answered as a fresh server within `startup_timeout_s` (a vLLM start-up takes 10 s to
        minutes, far longer than the heal interval). They are *restarting* from now on."""
        now = time.monotonic()
        due = [u for u in sorted(self.stuck) if self.restarting.get(u, now) <= now]
        self.restarting.update({u: now + self.startup_timeout_s for u in due})
        return due

    def take_out(self, url: str, why: str) -> None:
        """`url` leaves the run: no more syncs, joins nor heals. Its group is released (nccl: the one
        communicator, which it is in, and the others re-join a new one without it, or the next broadcast
        would wait for it; gloo: its own group and store), its version tag made one that is never the
        trainer's, so the rollout client never routes to it again, and its requests aborted."""
        self.urls.remove(url)
        self.taken_out[url] = why
        self.failed.pop(url, None)
        self.stuck.discard(url)
        self.restarting.pop(url, None)
        self.retry.pop(url, None)
        self.awaiting.discard(url)
        self.join_failing.discard(url)
        members = [u for u in self.urls if u in self.groups]
        self._release([url] + (members if self.backend == "nccl" else []))
        for path, body in (
            ("/update_weight_version", {"new_version": "out-of-step"}),
            ("/pause?mode=abort", None),
        ):
            try:
                post(url, path, body, self.http_timeout_s)
            except Exception:  # noqa: BLE001 - a dead server is out of routing already
                pass
        if self.backend == "nccl" and members:
            try:
                self.join(members)  # they need the weights again: `out_of_step` names them
            except WeightSyncError as e:  # those that answered have joined; heal retries the others
                print(f"weight-transfer group after taking {url} out: {e}", file=sys.stderr, flush=True)

    def rejoin(self) -> list[str]:
        """Give each server that is out of step (restarted, or failed a sync) and answers a new transfer
        group, once: one that joined waits for the weights (the next sync, or the caller's push) without a
        new group at every call. Returns those that joined: they still need the current weights. One
        that cannot join (or fails the sync after) is tried again after `join_retry_s[0]` seconds, the
        wait doubling up to `join_retry_s[1]`; it is named on stderr when it starts failing, not at each
        try."""
        stale = [u for u in self.out_of_step() if not (u in self.awaiting and u in self.groups)]
        now = time.monotonic()
        due = [u for u in stale if self.retry.get(u, (now, 0.0))[0] <= now]
        if not due:
            return []
        first, longest = self.join_retry_s
        for u in due:  # forgotten once a sync reaches it
            tries = self.retry[u][1] + 1 if u in self.retry else 0
            self.retry[u] = (now + doubling_wait(first, longest, tries), tries)
        try:
            self.join(due)
        except WeightSyncError as e:  # names the servers that did not join; those that did have joined
            if self.newly_failing([u for u in due if u not in self.groups]):
                print(
                    f"weight-transfer group: {e}. Tried again in {first:.0f} s, then at doubling waits up to "
                    f"{longest:.0f} s (not named again at each try)",
                    file=sys.stderr,
                    flush=True,
                )
        joined = [u for u in due if u in self.groups]
        self.awaiting.update(joined)
        return joined

    def newly_failing(self, urls: list[str]) -> list[str]:
        """Note `urls` as failing to come back (a join, or the push after it); returns those not noted
        since a sync last reached them: the ones to name on stderr (once, not at each try)."""
        new = [u for u in urls if u not in self.join_failing]
        self.join_failing.update(urls)
        return new

    def _worker_init_info(self, port: int, rank_offset: int, world_size: int) -> dict:
        info = dict(master_address=self.master_address, master_port=port, rank_offset=rank_offset)
        info["world_size"] = world_size
        if self.backend == "nccl":
            # vLLM's NCCL engine in packed mode; `_send` uses vLLM's matching packed producer.
            return info | dict(packed=True, packed_buffer_size_bytes=self.bucket_bytes, packed_num_buffers=2)
        return info | dict(timeout_s=self.transfer_timeout_s, bucket_bytes=self.bucket_bytes)

    def _join(self, port: int, world_size: int):
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            return trainer_init(
                dict(master_address=self.master_address, master_port=port, world_size=world_size)
            )
        store, group = gloo_group(self.master_address, port, 0, world_size, self.transfer_timeout_s)
        self.stores[group] = store
        return group

    def sync(
        self, named_params: Iterable[tuple[str, torch.Tensor]], version: int, urls: list[str] | None = None
    ) -> dict:
        """Load `named_params` (HF names, as `load_weights` expects; DTensors are gathered one at a
        time) into every joined server (or those of `urls`; nccl: all) and tag them with `version`;
        returns sync/ metrics.

        A server that fails (dead, erroring, or silent past its timeout) is dropped from the rest of
        the sync and leaves its group; the others finish the sync and are resumed; a failed server
        that still answers has its in-flight requests aborted (they ran on half-loaded weights) and
        stays paused until it is re-synced; then `WeightSyncError` names each failed server and the
        phase it failed in.
        """
        params = list(named_params)  # references only: nothing is gathered yet
        if self.rank != 0:
            for _, p in params:  # stay in step with rank 0's gathers
                _materialize(p)
            return {}
        # nccl: one communicator spans every joined server, so a subset sync would run a collective over
        # servers that are not in it (a hang until the transfer timeout): it syncs them all.
        targets = [u for u in (urls or self.urls) if u in self.groups]
        if self.backend == "nccl":
            targets = [u for u in self.urls if u in self.groups]
        if not targets:
            for _, p in params:  # the other FSDP ranks are in these gathers: never leave them waiting
                _materialize(p)
            # The trainer's weights are `version` even though no server got them: a server that comes
            # back must be brought to this version before the rollout client routes to it again (with
            # the last version's tag, it would wait for a sync that needs a batch it cannot make).
            self.version = version
            raise WeightSyncError(
                f"sync to version {version}: no server to sync (init() not called, or no server is joined: "
                + (", ".join(f"{u} failed in {m}" for u, m in self.failed.items()) or "none failed")
                + ")"
            )
        dtypes = [self.send_dtype or p.dtype for _, p in params]
        update_info = {
            "names": [n for n, _ in params],
            "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(p.shape) for _, p in params],
        }
        ok = list(targets)  # servers still in this sync
        failed: dict[str, str] = {}

        def drop(errors: dict[str, str], phase: str) -> None:
            for u, msg in errors.items():
                if u in ok:
                    ok.remove(u)
                    failed[u] = f"{phase}: {msg}"

        def phase(path: str, body: dict | None = None, name: str = "", call=post) -> None:
            t = time.perf_counter()
            name = name or path.strip("/").split("?")[0]
            drop(_call_all(ok, path, [body] * len(ok), self.http_timeout_s, call), name)
            self.phase_seconds[name] = time.perf_counter() - t

        t0 = time.perf_counter()
        self.phase_seconds = {}
        # vLLM's /pause (keep mode) ends with a 20 ms sleep (its comment: for the order of a caller's events,
        # not correctness), 20 % of a sync here; its level-0 sleep is the same pause without it. /pause
        # would also drop the KV cache, which the next call does: running requests are preempted, their
        # KV recomputed on the new weights on resume, and no cached prefix keeps the old weights' KV.
        phase("/sleep?level=0&mode=keep", name="pause")
        phase("/reset_prefix_cache?reset_running_requests=true", name="reset KV cache", call=_reset_kv)
        phase("/start_weight_update")
        if self.backend == "nccl" and failed and ok:
            # A member of the one communicator dropped out before the broadcast: a collective without
            # it would hang. No broadcast this time: the others put their old weights back and fail
            # too; `heal` re-forms the group with the servers that answer.
            phase("/finish_weight_update")
            why = f"{', '.join(failed)} left before the broadcast (one nccl group spans every server)"
            drop({u: why for u in ok}, "update_weights")
        # The servers receive inside /update_weights, so it runs while we broadcast.
        pool = ThreadPoolExecutor(max_workers=max(1, len(ok)))
        receiving = list(ok)
        body = {"update_info": update_info}
        futures = [pool.submit(post, u, "/update_weights", body, self.transfer_timeout_s) for u in receiving]
        pool.shutdown(wait=False)
        t_send = time.perf_counter()
        num_bytes, send_errors = self._send(params, dtypes, receiving)
        send_s = time.perf_counter() - t_send
        # The server's own error first: a broadcast fails only because its receiver gave up, which says why.
        drop(_collect(receiving, futures, self.transfer_timeout_s), "update_weights")
        drop(send_errors, "update_weights (broadcast)")
        self.phase_seconds["update_weights"] = time.perf_counter() - t_send
        phase("/finish_weight_update", {"weight_version": str(version)})  # tagged only once it finished
        phase("/wake_up?tags=scheduling", name="resume", call=_resume)  # ends the level-0 sleep: /resume
        seconds = time.perf_counter() - t0
        self.version = version  # what the trainer's weights are now, whoever received them
        for u in ok:
            self.reached(u)
        if failed:
            self.awaiting.difference_update(failed)  # its group is released below: `rejoin` gives a new one
            # Its group is out of step or gone: released (an NCCL one destroyed, which also ends the
            # kernel a timed-out broadcast left queued on the stream); a new one on rejoin.
            self._release(list(failed))
            self.failed.update(failed)
            dead = [u for u in failed if not healthy(u)]
            # All at once: an engine stuck in a receive answers /health but not /pause (http_timeout_s
            # each). Their errors are not reported: the sync error below is the one that matters.
            alive = [u for u in failed if u not in dead]
            _call_all(alive, "/pause?mode=abort", [None] * len(alive), self.http_timeout_s)
            raise WeightSyncError(
                f"weight sync to version {version} failed on {len(failed)} server(s), "
                f"{len(ok)} got it; not responding: {', '.join(dead) or 'none'}; "
                + (
                    f"stuck in the NCCL receive (restart them): {', '.join(sorted(self.stuck))}; "
                    if self.stuck
                    else ""
                )
                + "; ".join(f"{u} failed in {m}" for u, m in failed.items())
            )
        mb = num_bytes / 1e6
        return {
            "sync/seconds": seconds,
            "sync/send_seconds": send_s,
            "sync/mb": mb,
            "sync/mb_per_s": mb / seconds,
        }

    def _send(
        self, params: list[tuple[str, torch.Tensor]], dtypes: list[torch.dtype], urls: list[str]
    ) -> tuple[int, dict[str, str]]:
        """Broadcast every tensor from rank 0 to the servers `urls`; returns (bytes, {url: error})."""
        if not urls:  # every target failed before the broadcast: the other FSDP ranks gather anyway
            for _, p in params:
                _materialize(p)
            return 0, {}
        num_bytes = 0

        def full_tensors():
            nonlocal num_bytes
            for (name, p), dtype in zip(params, dtypes):
                t = _materialize(p).detach().to(dtype)
                num_bytes += t.numel() * t.element_size()
                yield name, t

        if self.backend == "nccl":
            try:
                self._nccl_broadcast(self.groups[urls[0]], full_tensors())
            except Exception as e:  # one group: it fails for everyone
                if isinstance(e, TimeoutError):
                    self.stuck.update(urls)
                return num_bytes, {u: f"{type(e).__name__}: {e}" for u in urls}
            return num_bytes, {}

        live = list(urls)
        errors: dict[str, str] = {}
        timeout = datetime.timedelta(seconds=self.transfer_timeout_s)
        shapes = [list(p.shape) for _, p in params]
        it = full_tensors()
        in_flight: deque = deque()  # (piece's buffer, [(url, its broadcast)]), oldest first
        in_flight_bytes = 0

        def wait_oldest() -> None:
            nonlocal in_flight_bytes
            buf, works = in_flight.popleft()
            in_flight_bytes -= buf.numel()
            for u, work in works:
                if u not in live:  # failed on an earlier piece: its later ones are not waited for
                    continue
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001 - this server is dropped, the others go on
                    errors[u] = f"{type(e).__name__}: {str(e)[:500]}"
                    live.remove(u)

        for piece in plan_buckets(shapes, dtypes, PIECE_BYTES):
            # Gathered in order (FSDP's collectives); a tensor alone is sent from its own memory, small
            # ones are copied into one buffer. Each piece is posted to every server at once, while the
            # pieces before it are still in flight (up to `bucket_bytes` of them).
            tensors = [_to_bytes(next(it)[1].cpu()) for _ in piece]
            buf = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            while in_flight and in_flight_bytes + buf.numel() > self.bucket_bytes:
                wait_oldest()
            in_flight.append((buf, [(u, self.groups[u].broadcast(buf, 0, timeout)) for u in live]))
            in_flight_bytes += buf.numel()
        while in_flight:
            wait_oldest()
        return num_bytes, errors

    def _nccl_broadcast(self, group, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """vLLM's packed producer over the one communicator, on a thread we stop waiting for (an NCCL
        broadcast to a dead peer has no timeout of its own), fed by the gathers on this thread (`_feed`)."""
        on_gpu = torch.cuda.is_available()
        # No synchronize first: each tensor's event (`_feed`) also orders its read after the optimizer
        # step and the gather queued before it on this thread's stream.
        device = torch.cuda.current_device() if on_gpu else None

        def send(items: Iterator) -> None:
            if on_gpu:
                torch.cuda.set_device(device)  # a new thread starts on device 0
            self._produce(group, items)
            if on_gpu:
                torch.cuda.current_stream().synchronize()

        _feed(send, tensors, self.transfer_timeout_s, "NCCL broadcast")

    def _produce(self, group, items: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(
            iterator=items, group=group, src=0, post_iter_func=lambda item: item[1],
            buffer_size_bytes=self.bucket_bytes, num_buffers=2,
        )  # fmt: skip

    def close(self) -> None:
        """Release the groups on both sides; the servers keep serving."""
        live = [u for u in self.urls if u in self.groups and healthy(u)]
        if self.rank == 0 and live:
            _call_all(live, "/shutdown_weight_transfer_engine", [None] * len(live), self.http_timeout_s)
        self._release(list(self.groups))


def _materialize(p: torch.Tensor) -> torch.Tensor:
    # FSDP2 DTensor: all-gather this one parameter now (a collective on every trainer rank).
    full_tensor = getattr(p, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else p
