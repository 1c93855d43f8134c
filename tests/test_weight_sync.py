"""weight_sync.py against real vLLM servers on the CPU (gloo transport).

The proof: after a sync, vLLM's prompt logprobs for a fixed token sequence equal the trainer's own
(transformers, float32) within 1e-3; before it they differ. Each server start costs ~50 s here, so the
file starts three (tiny, a second tiny, tiny-tied) and the tests run in order on them: one server
twice, the tied model, a server dead before a sync (the tied one), two servers, a server killed
mid-sync and restarted. At most two servers are up at a time.
"""

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import side_by_side
from test_fidelity import _group
from transformers import AutoModelForCausalLM

import weight_sync
from weight_sync import WeightSyncer, WeightSyncError

pytestmark = pytest.mark.timeout(400)

REPO = Path(__file__).resolve().parent.parent
TOKENS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 300, 21]  # a fixed prompt, all ids < vocab
TOL = 1e-3


def _model_dir(name: str, tie: bool) -> str:
    path = REPO / "models" / name
    if not (path / "config.json").exists():
        cmd = [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(path)]
        subprocess.run(cmd + (["--tie"] if tie else []), check=True)
    return str(path)


@pytest.fixture(scope="module")
def server_a(trainer_server):
    """The session's server: its tiny-warm has tiny's shapes, so a sync of tiny's weights replaces it."""
    return trainer_server


@pytest.fixture(scope="module")
def own_servers(tmp_path_factory):
    """(server_b on tiny, server_tied on tiny-tied), started side by side."""
    with side_by_side(
        tmp_path_factory.mktemp("vllm"),
        dict(model=_model_dir("tiny", tie=False)),
        dict(model=_model_dir("tiny-tied", tie=True)),
    ) as servers:
        yield servers


@pytest.fixture(scope="module")
def server_b(own_servers):
    return own_servers[0]


@pytest.fixture(scope="module")
def server_tied(own_servers):
    return own_servers[1]


def load_trainer_model(name: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(REPO / "models" / name), dtype=torch.float32).eval()


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([TOKENS])
    logits = model(ids).logits.float()  # (1, T, V)
    logp = torch.log_softmax(logits[0, :-1], dim=-1)  # position t predicts token t+1
    return logp.gather(1, ids[0, 1:, None])[:, 0]  # (T-1,)


def server_logprobs(url: str) -> torch.Tensor:
    import json

    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = {
        "model": model,
        "prompt": TOKENS,
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 1.0,
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        prompt_logprobs = json.loads(r.read())["choices"][0]["prompt_logprobs"]
    # Entry t (t >= 1) holds the logprob of TOKENS[t] given TOKENS[:t]; entry 0 is None.
    return torch.tensor([prompt_logprobs[t][str(TOKENS[t])]["logprob"] for t in range(1, len(TOKENS))])


def max_diff(model: torch.nn.Module, url: str) -> float:
    return (trainer_logprobs(model) - server_logprobs(url)).abs().max().item()


def weight_version(url: str) -> str:
    import json

    with urllib.request.urlopen(url + "/weight_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


def test_sync_one_server_twice(server_a):
    model = load_trainer_model("tiny")
    perturb(model, seed=1)
    assert max_diff(model, server_a.url) > 10 * TOL  # the perturbation is visible before the sync

    log_start = server_a.log_size()  # the session's server: earlier tests' calls are before it
    syncer = WeightSyncer([server_a.url])
    syncer.init()
    metrics = syncer.sync(model.named_parameters(), version=1)
    assert max_diff(model, server_a.url) < TOL, metrics
    assert weight_version(server_a.url) == "1"
    assert set(metrics) >= {"sync/seconds", "sync/mb", "sync/mb_per_s"}
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert metrics["sync/mb"] == pytest.approx(num_bytes / 1e6)

    # A re-join (heal's, after a failed sync) releases the old group on both sides: the server's engine
    # is shut down before it is told to join again, the trainer keeps one store, not one per join.
    syncer.join([server_a.url])
    syncer.join([server_a.url])
    assert len(syncer.stores) == 1 and len(syncer.groups) == 1
    calls = [
        x.split('"POST ')[1].split()[0]
        for x in server_a.log_since(log_start).splitlines()
        if "_weight_transfer_engine HTTP" in x
    ]
    assert calls == ["/shutdown_weight_transfer_engine", "/init_weight_transfer_engine"] * 3, calls

    perturb(model, seed=2)  # the second sync must work too
    assert max_diff(model, server_a.url) > 10 * TOL
    metrics = syncer.sync(model.named_parameters(), version=2)
    assert max_diff(model, server_a.url) < TOL, metrics
    assert weight_version(server_a.url) == "2"
    print(f"\none server: {metrics}")
    syncer.close()


def sampled_logprob(url: str, prompt: list[int]) -> tuple[int, float]:
    import json

    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "logprobs": 0, "return_token_ids": True}
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        body["model"] = json.loads(r.read())["data"][0]["id"]
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    return choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]


def test_prefix_cache_holds_no_old_weights_after_sync(server_a):
    """A prompt cached before a sync must not be served from KV computed with the old weights: the
    first token sampled after the sync has exactly the new policy's logprob (the sync's
    `/reset_prefix_cache?reset_running_requests=true`, while the server is paused; failed without it)."""
    prompt = [3 + (i * 37) % 500 for i in range(400)]  # several KV blocks long
    model = load_trainer_model("tiny")
    perturb(model, seed=3)
    syncer = WeightSyncer([server_a.url])
    syncer.init()
    syncer.sync(model.named_parameters(), version=3)
    sampled_logprob(server_a.url, prompt)  # now the prompt's blocks are in the prefix cache
    perturb(model, seed=4)
    syncer.sync(model.named_parameters(), version=4)
    token, logprob = sampled_logprob(server_a.url, prompt)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], -1)[token].item()
    syncer.close()
    assert abs(logprob - expected) < TOL, f"stale prefix cache: vLLM {logprob:.4f} vs trainer {expected:.4f}"


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_a_request_running_through_a_sync_goes_on_from_the_new_weights_alone(server_a):
    """A completion still generating when a sync comes (the rollout worker's usual case) continues on
    the new weights over its whole context: each of its tokens has the logprob that one policy, old or
    new, gives it after everything before it. A token computed by the new weights over the KV the old
    ones wrote would match neither (the sync preempts running requests, whose KV is then recomputed)."""
    import json
    import threading

    old = load_trainer_model("tiny")
    perturb(old, seed=5)
    new = load_trainer_model("tiny")
    new.load_state_dict(old.state_dict())
    perturb(new, seed=6)
    syncer = WeightSyncer([server_a.url])
    syncer.init()
    syncer.sync(old.named_parameters(), version=5)
    with urllib.request.urlopen(server_a.url + "/v1/models", timeout=30) as r:
        served = json.loads(r.read())["data"][0]["id"]
    prompt = TOKENS
    body = {"model": served, "prompt": prompt, "max_tokens": 1500, "temperature": 1.0, "logprobs": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": 1}  # fmt: skip
    req = urllib.request.Request(
        server_a.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    completion, logprobs, started = [], [], threading.Event()

    def read_stream() -> None:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                completion.extend(choice["token_ids"])
                logprobs.extend(choice["logprobs"]["token_logprobs"])
                if len(completion) >= 30:
                    started.set()
        started.set()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert started.wait(120)
    synced_at = len(completion)
    syncer.sync(new.named_parameters(), version=6)
    reader.join(120)
    syncer.close()
    # ~3 s of generation here against a sync of ~0.05 s: room for a slow sync on a loaded machine.
    assert len(completion) == 1500 and synced_at < 1500, (synced_at, len(completion))
    served_lp = torch.tensor(logprobs)
    on_old = (served_lp - sequence_logprobs(old, prompt, completion)).abs() < TOL
    on_new = (served_lp - sequence_logprobs(new, prompt, completion)).abs() < TOL
    switch = int((~on_old).nonzero()[0]) if not on_old.all() else len(completion)
    print(f"\n{synced_at} tokens read at the sync, the first on the new weights: {switch}")
    assert 0 < switch < len(completion) - 100, (synced_at, switch)  # some of each, no garbage first
    astray = (~on_new[switch:]).nonzero()[:5, 0] + switch
    assert on_new[switch:].all(), f"tokens {astray.tolist()}... match neither policy"


def test_sync_tied_embeddings(server_tied):
    # vLLM's CPU backend pre-packs the lm_head GEMM at load; a tied lm_head receives no weight of its
    # own in a sync, so without `weight_sync_server._repack_cpu_embedding_gemms` its logits come from the
    # old embedding.
    model = load_trainer_model("tiny-tied")
    assert model.config.tie_word_embeddings
    assert "lm_head.weight" not in dict(model.named_parameters())  # one shared tensor
    perturb(model, seed=3)
    assert max_diff(model, server_tied.url) > 10 * TOL
    syncer = WeightSyncer([server_tied.url])
    syncer.init()
    for version in (1, 2):
        syncer.sync(model.named_parameters(), version=version)
        assert max_diff(model, server_tied.url) < TOL
        perturb(model, seed=4)
    syncer.close()


def test_server_dead_before_sync(server_tied):
    syncer = WeightSyncer([server_tied.url], http_timeout_s=10, transfer_timeout_s=30)
    syncer.init()
    server_tied.stop(grace_s=0)
    model = load_trainer_model("tiny-tied")
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as err:
        syncer.sync(model.named_parameters(), version=1)
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert server_tied.url in msg and "pause" in msg, msg
    with pytest.raises(WeightSyncError):  # the dead server was dropped: nothing left to sync
        syncer.sync(model.named_parameters(), version=2)


def test_sync_two_servers(server_a, server_b):
    model = load_trainer_model("tiny")
    perturb(model, seed=5)
    assert max_diff(model, server_b.url) > 10 * TOL
    syncer = WeightSyncer([server_a.url, server_b.url])
    syncer.init()
    metrics = syncer.sync(model.named_parameters(), version=7)
    for url in (server_a.url, server_b.url):
        assert max_diff(model, url) < TOL
        assert weight_version(url) == "7"
    print(f"\ntwo servers: {metrics}")
    syncer.close()


class KillOnGather:
    """Stands in for an FSDP DTensor: `full_tensor()` is called mid-sync, after pause and start; this
    one kills a server there, the worst moment for the sync."""

    def __init__(self, tensor: torch.Tensor, server):
        self.tensor, self.server = tensor, server
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def full_tensor(self) -> torch.Tensor:
        self.server.stop(grace_s=0)  # SIGKILL to the API server and its engine process
        time.sleep(1)
        return self.tensor


def test_server_killed_mid_sync(server_a, server_b):
    model = load_trainer_model("tiny")
    perturb(model, seed=6)
    syncer = WeightSyncer([server_a.url, server_b.url], http_timeout_s=10, transfer_timeout_s=30)
    syncer.init()
    params = list(model.named_parameters())
    params[3] = (params[3][0], KillOnGather(params[3][1].detach(), server_b))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as err:
        syncer.sync(params, version=8)
    assert time.monotonic() - t0 < 60
    msg = str(err.value)
    assert server_b.url in msg and "update_weights" in msg and server_a.url not in msg, msg
    # The survivor got the whole sync and was resumed: it serves, with the new weights.
    assert max_diff(model, server_a.url) < TOL
    assert weight_version(server_a.url) == "8"
    # The syncer carries on with the survivor alone.
    perturb(model, seed=7)
    syncer.sync(model.named_parameters(), version=9)
    assert max_diff(model, server_a.url) < TOL
    assert syncer.out_of_step() == []  # the dead server is not named until it answers
    # The server comes back (base weights, version "default", no transfer group): it is named, joins a
    # new group and gets the current weights; the survivor is left alone.
    server_b.restart()
    server_b.wait_healthy(300)
    assert weight_version(server_b.url) == "default"
    assert syncer.out_of_step() == [server_b.url]
    syncer.join([server_b.url])
    syncer.sync(model.named_parameters(), version=9, urls=[server_b.url])
    assert max_diff(model, server_b.url) < TOL and weight_version(server_b.url) == "9"
    assert syncer.out_of_step() == [] and syncer.failed == {}
    perturb(model, seed=8)  # and both take the next sync as one again
    syncer.sync(model.named_parameters(), version=10)
    assert max(max_diff(model, server_a.url), max_diff(model, server_b.url)) < TOL
    syncer.close()


def test_plan_buckets_cuts_identically():
    shapes = [[10, 10], [5], [1000], [3, 3]]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32]
    buckets = weight_sync.plan_buckets(shapes, dtypes, bucket_bytes=500)
    assert buckets == [[0, 1], [2], [3]]  # 400+20 fit; 2000 alone; 36 starts a new one
    assert sum(buckets, []) == list(range(len(shapes)))


def test_raw_gloo_broadcast_bench():
    from bench.bench_weight_sync import raw_gloo_broadcaster

    with raw_gloo_broadcaster(1_000_000, repeats=2) as time_one:
        assert 0 < time_one() < 10 and 0 < time_one() < 10


# ---------------------------------------------------------------------------------------------------
# FAILURES THE REAL SERVERS CANNOT PRODUCE ON DEMAND: fake servers (real HTTP) and a fake communicator
# that refuses a collective over a server not inside /update_weights (a real NCCL broadcast would hang)
# ---------------------------------------------------------------------------------------------------
class FakeServer:
    """Answers vLLM's weight-transfer routes over real HTTP; `fail` = route prefixes answered with 500."""

    def __init__(self, fail: tuple[str, ...] = ()):
        import http.server
        import json
        import threading

        fake = self
        self.fail, self.calls, self.version, self.init_ports = fail, [], "default", []
        self.kv_reset = True  # what /reset_prefix_cache answers (vLLM: false while blocks are held)
        self.sleeping = False  # /wake_up answers "sleeping" (put to sleep at another level by someone else)
        self.down_until = 0.0  # monotonic time until which it is starting up: every route answers 503
        self.tag_asks = 0  # GET /weight_info answered
        self.before_tag = lambda: None  # runs before /weight_info answers (a busy engine's step)
        self.before_post = lambda path: None  # runs before a POST is answered (an engine stuck in a receive)
        self.on_init = lambda init_info: None  # runs inside /init_weight_transfer_engine (a worker joining)

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def answer(self, body: dict, code: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if time.monotonic() < fake.down_until:
                    return self.answer({}, 503)
                if self.path == "/get_world_size":
                    return self.answer({"world_size": 1})
                if self.path == "/weight_info":
                    fake.before_tag()
                    fake.tag_asks += 1
                    return self.answer({"weight_version": fake.version})
                self.answer({})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if time.monotonic() < fake.down_until:
                    return self.answer({}, 503)
                fake.calls.append(self.path)
                fake.before_post(self.path)
                if self.path.startswith(fake.fail):
                    return self.answer({"error": "injected"}, 500)
                if self.path == "/init_weight_transfer_engine":
                    fake.init_ports.append(body["init_info"]["master_port"])
                    fake.on_init(body["init_info"])
                if self.path == "/finish_weight_update" and body.get("weight_version") is not None:
                    fake.version = body["weight_version"]
                if self.path.startswith("/reset_prefix_cache"):
                    return self.answer({"success": fake.kv_reset})
                if self.path.startswith("/wake_up"):
                    return self.answer({"status": "sleeping" if fake.sleeping else "awake"})
                self.answer({})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def receiving(self) -> bool:
        """Inside /update_weights of the current sync (posted after the last /start_weight_update)."""
        starts = [i for i, c in enumerate(self.calls) if c == "/start_weight_update"]
        return bool(starts) and "/update_weights" in self.calls[starts[-1] :]

    def kill(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeComm:
    """A communicator over the servers that were asked to join it (their /init_weight_transfer_engine
    named its port). A broadcast while a member is not receiving fails at once, where NCCL would hang."""

    def __init__(self, port: int, servers: list[FakeServer]):
        self.port, self.servers, self.broadcasts, self.destroyed = port, servers, 0, 0

    def members(self) -> list[FakeServer]:
        return [s for s in self.servers if s.init_ports and s.init_ports[-1] == self.port]

    def check(self) -> None:
        deadline = time.monotonic() + 5  # /update_weights is posted on threads, as the broadcast starts
        while not all(s.receiving() for s in self.members()):
            assert time.monotonic() < deadline, "a collective over a server outside the sync: NCCL hangs here"
            time.sleep(0.01)
        self.broadcasts += 1

    def broadcast(self, buf, src, timeout):  # gloo's interface: returns a work to wait on
        self.check()
        return SimpleWork()

    def destroy(self) -> None:  # PyNcclCommunicator's
        self.destroyed += 1


class SimpleWork:
    def wait(self) -> None:
        pass


class CountingParam:
    """Stands in for an FSDP DTensor: counts the `full_tensor()` gathers (collectives on every rank)."""

    gathers = 0

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape, self.dtype = tensor, tensor.shape, tensor.dtype

    def full_tensor(self) -> torch.Tensor:
        CountingParam.gathers += 1
        return self.tensor


def fake_syncer(backend: str, servers: list[FakeServer]) -> tuple[WeightSyncer, list[FakeComm]]:
    syncer = WeightSyncer([s.url for s in servers], backend=backend, http_timeout_s=5, transfer_timeout_s=5)
    comms: list[FakeComm] = []

    def join(port: int, world_size: int) -> FakeComm:
        comms.append(FakeComm(port, servers))
        return comms[-1]

    def nccl_broadcast(group: FakeComm, tensors) -> None:
        group.check()
        for _ in tensors:  # the gathers happen as the producer pulls each tensor
            pass

    syncer._join = join
    syncer._stand_in = lambda port, world_size: None  # no rendezvous is hosted to dial in a refuser's place
    syncer._nccl_broadcast = nccl_broadcast
    return syncer, comms


def counting_params(n: int = 4) -> list[tuple[str, CountingParam]]:
    CountingParam.gathers = 0
    return [(f"w{i}", CountingParam(torch.full((3, 2), float(i)))) for i in range(n)]


def test_nccl_subset_sync_runs_no_collective_over_servers_left_out():
    servers = [FakeServer(), FakeServer(), FakeServer()]
    syncer, comms = fake_syncer("nccl", servers)
    syncer.init()
    assert len(comms) == 1 and comms[0].members() == servers
    syncer.sync(counting_params(), version=1)
    # heal()'s call: only the first server is out of step, but it shares the one communicator
    syncer.sync(counting_params(), version=2, urls=[servers[0].url])
    assert comms[0].broadcasts == 2 and CountingParam.gathers == 4
    assert [s.version for s in servers] == ["2", "2", "2"]


def test_nccl_member_failing_before_the_broadcast_fails_the_sync_without_a_collective():
    servers = [FakeServer(), FakeServer(fail=("/start_weight_update",))]
    syncer, comms = fake_syncer("nccl", servers)
    syncer.init()
    with pytest.raises(WeightSyncError) as e:
        syncer.sync(counting_params(), version=1)
    assert comms[0].broadcasts == 0 and CountingParam.gathers == 4  # no collective, every gather
    assert "left before the broadcast" in str(e.value)
    assert "/finish_weight_update" in servers[0].calls  # the healthy one put its old weights back
    servers[1].fail = ()
    assert syncer.out_of_step() == [s.url for s in servers]
    syncer.join(syncer.out_of_step())
    syncer.sync(counting_params(), version=2)
    assert comms[-1].broadcasts == 1 and [s.version for s in servers] == ["2", "2"]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_sync_with_every_target_failed_still_does_every_gather(backend):
    servers = [FakeServer(fail=("/sleep",)), FakeServer(fail=("/start_weight_update",))]
    syncer, comms = fake_syncer(backend, servers)
    syncer.init()
    with pytest.raises(WeightSyncError) as e:
        syncer.sync(counting_params(5), version=1)
    assert CountingParam.gathers == 5  # in step with the other FSDP ranks, which gather all 5
    assert all(c.broadcasts == 0 for c in comms)
    assert servers[0].url in str(e.value) and servers[1].url in str(e.value)


def test_a_server_that_keeps_its_kv_cache_fails_the_sync_and_stays_paused():
    """vLLM answers success false when it could not drop its KV cache: that server would go on from KV
    the old weights wrote, so it fails the sync (named, with the phase), its requests are aborted and it
    stays paused; the other one takes the sync and is resumed."""
    servers = [FakeServer(), FakeServer()]
    servers[1].kv_reset = False
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    with pytest.raises(WeightSyncError) as e:
        syncer.sync(counting_params(), version=1)
    assert f"{servers[1].url} failed in reset KV cache" in str(e.value), e.value
    assert servers[0].version == "1" and servers[0].calls[-1] == "/wake_up?tags=scheduling"
    assert servers[1].version == "default" and servers[1].calls[-1] == "/pause?mode=abort"


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_join_keeps_the_healthy_servers_when_one_is_dead(backend):
    servers = [FakeServer(), FakeServer(), FakeServer()]
    syncer, comms = fake_syncer(backend, servers)
    syncer.init()
    servers[1].kill()
    with pytest.raises(WeightSyncError) as e:
        syncer.join([s.url for s in servers])
    assert servers[1].url in str(e.value) and "did not answer" in str(e.value)
    healthy = [servers[0].url, servers[2].url]
    assert sorted(syncer.groups) == sorted(healthy)
    syncer.sync(counting_params(), version=3)
    assert [servers[0].version, servers[2].version] == ["3", "3"]
    assert servers[0].calls[-1] == servers[2].calls[-1] == "/wake_up?tags=scheduling"  # not left paused


def test_nccl_rejoin_destroys_the_old_communicator_on_both_sides():
    """heal's re-join re-forms the one communicator: the trainer destroys its old one (ncclCommAbort:
    its GPU memory, and any kernel a failed broadcast left queued), and each server is told to shut its
    engine down before it joins again (vLLM's NCCL engine would otherwise overwrite its communicator
    and leak it, on servers sized to 0.9 of GPU memory)."""
    servers = [FakeServer(), FakeServer()]
    syncer, comms = fake_syncer("nccl", servers)
    syncer.init()
    syncer.join(syncer.urls)
    syncer.join(syncer.urls)
    assert [c.destroyed for c in comms] == [1, 1, 0]
    for s in servers:
        joins = [c for c in s.calls if c.endswith("_weight_transfer_engine")]
        assert joins[-4:] == ["/shutdown_weight_transfer_engine", "/init_weight_transfer_engine"] * 2
    syncer.sync(counting_params(), version=1)
    assert comms[-1].broadcasts == 1 and [s.version for s in servers] == ["1", "1"]
    syncer.close()
    assert comms[-1].destroyed == 1


def test_nccl_broadcast_timeout_destroys_the_communicator():
    """An NCCL broadcast that times out (a server died mid-transfer) leaves its kernel queued on the
    stream, where it would wedge every later sync: the communicator is destroyed (ncclCommAbort). The
    surviving servers wait in vLLM's packed consumer (no timeout) while /health answers: they are
    named as stuck (relaunch_exited restarts launched ones) and not re-joined until they come back
    fresh; then they join a new communicator and take the next sync."""
    servers = [FakeServer(), FakeServer()]
    syncer, comms = fake_syncer("nccl", servers)

    def hangs(group, tensors) -> None:
        next(tensors)  # one buffer out, then the peer is gone
        raise TimeoutError("NCCL broadcast did not finish within 5 s")

    syncer.init()
    syncer.sync(counting_params(), version=1)
    working, syncer._nccl_broadcast = syncer._nccl_broadcast, hangs
    with pytest.raises(WeightSyncError, match="NCCL broadcast did not finish") as e:
        syncer.sync(counting_params(), version=2)
    assert "stuck in the NCCL receive (restart them): " + ", ".join(sorted(syncer.urls)) in str(e.value)
    assert comms[0].destroyed == 1 and syncer.groups == {} and syncer.stuck == set(syncer.urls)
    assert syncer.out_of_step() == []  # alive, version 1, inside the receive: a join would hang
    for s in servers:  # relaunched: a fresh server reports version "default"
        s.version = "default"
    syncer._nccl_broadcast = working
    syncer.join(syncer.out_of_step())
    syncer.sync(counting_params(), version=3)
    assert len(comms) == 2 and comms[1].broadcasts == 1 and [s.version for s in servers] == ["3", "3"]
    assert syncer.stuck == set() and syncer.failed == {}


def _hang_rank(rank: int, port: int, out: Path) -> None:
    """One FSDP rank (gloo) of a 2-rank trainer syncing over a fake one-server NCCL group whose first
    broadcast hangs after two tensors (the server died mid-transfer)."""
    import json
    import os

    import torch.distributed as dist

    from distributed import init_distributed, shard_model

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))  # fmt: skip
    init_distributed(0, 60)
    model = load_trainer_model("tiny")
    shard_model(model)
    if rank == 0:
        servers = [FakeServer()]
        syncer, comms = fake_syncer("nccl", servers)
        del syncer._nccl_broadcast  # the real one: gathers here, the send on its thread
        taken = []

        def hangs(group, items) -> None:
            taken.extend([next(items), next(items)])
            time.sleep(3600)  # a broadcast to a dead peer: never returns

        syncer._produce = hangs
        syncer.init()
    else:
        syncer = WeightSyncer([], backend="nccl", rank=1)  # gathers only, as follow_rank0's
    t0 = time.monotonic()
    try:
        syncer.sync(model.named_parameters(), version=1)
        error = None
    except WeightSyncError as e:
        error = str(e)
    dist.barrier()  # the next collective of the run: both ranks must reach it, in step
    left_after = time.monotonic() - t0
    if rank == 0:
        received = []
        syncer._produce = lambda group, items: received.extend(items)
        syncer.join(syncer.out_of_step())
        syncer.sync(model.named_parameters(), version=2)
    else:
        syncer.sync(model.named_parameters(), version=2)
    dist.barrier()
    if rank == 0:
        every = [n for n, _ in received] == [n for n, _ in model.named_parameters()]
        result = {"error": error, "left_after": left_after, "destroyed": comms[0].destroyed,
                  "second": every, "version": servers[0].version}  # fmt: skip
        (out / "rank0.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)  # the hung send thread is a daemon: do not wait for it


@pytest.mark.timeout(300)
def test_a_broadcast_that_hangs_mid_sync_leaves_every_fsdp_rank_in_step(tmp_path):
    """2 FSDP ranks over gloo; rank 0's NCCL send hangs after two tensors. Rank 0 still makes every
    gather (on its main thread, feeding the send thread through a bounded queue), so both ranks leave
    the sync together and meet at the next collective; the sync fails naming the server, its
    communicator is destroyed, and the next sync (a new communicator) sends every tensor."""
    import json
    import multiprocessing

    from vllm_server import free_port

    # Forked: a spawned rank imports this module (torch, transformers) again, ~5 s of CPU each.
    ctx, port = multiprocessing.get_context("fork"), free_port()
    procs = [ctx.Process(target=_hang_rank, args=(r, port, tmp_path)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert "NCCL broadcast did not finish within 5 s" in r["error"]
    assert r["left_after"] < 60 and r["destroyed"] == 1
    assert r["second"] and r["version"] == "2"


# ---------------------------------------------------------------------------------------------------
# EACH SERVER'S SYNC STATE, changed by WeightSyncer alone: the fault paths as they run in an outage
# ---------------------------------------------------------------------------------------------------
class LaunchedServer:
    """vllm_server.VLLMServer's face to relaunch_exited: a restart makes the fake server a fresh one that
    takes `start_s` to answer (a vLLM start-up: 10 s on CPU, minutes on GPU)."""

    def __init__(self, fake: FakeServer, start_s: float):
        self.fake, self.url, self.start_s, self.restarts = fake, fake.url, start_s, 0
        self.proc = SimpleNamespace(pid=os.getpid(), returncode=None)

    def alive(self) -> bool:
        return True

    def restart(self) -> None:
        self.restarts += 1
        self.fake.version, self.fake.init_ports = "default", []
        self.fake.down_until = time.monotonic() + self.start_s


def stuck_run(tmp_path, start_s: float):
    """A run whose two nccl servers are stuck: a broadcast timed out mid-sync."""
    import train_async_grpo as T

    servers = [FakeServer(), FakeServer()]
    syncer, comms = fake_syncer("nccl", servers)
    syncer.startup_timeout_s = 30
    model = torch.nn.Linear(2, 2)
    syncer.init()
    syncer.sync(model.named_parameters(), version=1)
    working = syncer._nccl_broadcast

    def hangs(group, tensors) -> None:
        next(tensors)
        raise TimeoutError("NCCL broadcast did not finish within 5 s")

    syncer._nccl_broadcast = hangs
    with pytest.raises(WeightSyncError):
        syncer.sync(model.named_parameters(), version=2)
    syncer._nccl_broadcast = working
    launched = [LaunchedServer(s, start_s) for s in servers]
    run = SimpleNamespace(servers=launched, out_dir=tmp_path, syncer=syncer, model=model, version=2,
                          world_size=1, moved_since_sync=False)  # fmt: skip
    (tmp_path / "vllm-logs").mkdir()
    return T, run, servers, comms


def test_heal_restarts_a_stuck_server_once_while_it_starts_up(tmp_path):
    """heal runs every few seconds while the loop waits for a batch; a stuck server's restart takes
    longer than that. It is restarted once, left out of every join while it starts (a group formed
    with it would wait for it), and brought back with the current weights once it answers fresh.
    (It was restarted on every heal, so no restarted server ever came back.)"""
    T, run, servers, comms = stuck_run(tmp_path, start_s=1.5)
    assert run.syncer.stuck == {s.url for s in servers}
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        T.heal(run)
        time.sleep(0.1)  # the heal interval, shorter than the start-up
    assert [s.restarts for s in run.servers] == [1, 1]
    assert [s.version for s in servers] == ["2", "2"] and run.syncer.stuck == set()
    assert run.syncer.restarting == {} and comms[-1].broadcasts == 1


def test_a_start_up_that_never_answers_is_restarted_after_the_start_up_timeout(tmp_path, monkeypatch):
    T, run, servers, _ = stuck_run(tmp_path, start_s=3600)
    run.syncer.startup_timeout_s = 0.5
    now = [time.monotonic()]

    class Clock:  # the syncer's clock, 0.1 s a heal: the count may not depend on how loaded the machine is
        monotonic = staticmethod(lambda: now[0])

        def __getattr__(self, name):
            return getattr(time, name)

    monkeypatch.setattr(weight_sync, "time", Clock())
    for _ in range(8):  # heals at 0.0 .. 0.7 s: restarted at 0.0 and again at 0.5
        T.heal(run)
        now[0] += 0.1
    assert [s.restarts for s in run.servers] == [2, 2]


def test_nccl_join_leaves_stuck_servers_out():
    """A stuck server still answers /get_world_size; a communicator formed with it would wait for it."""
    servers = [FakeServer(), FakeServer(), FakeServer()]
    syncer, comms = fake_syncer("nccl", servers)
    syncer.init()
    syncer.stuck.add(servers[1].url)
    syncer.join(syncer.urls)
    assert comms[-1].members() == [servers[0], servers[2]] and servers[1].url not in syncer.groups
    syncer.sync(counting_params(), version=1)
    assert [s.version for s in servers] == ["1", "default", "1"]


def test_heal_reads_the_weight_tags_asked_during_the_step_and_asks_again_after_a_sync():
    """poll_ahead asks for the tags while the trainer steps; heal's out_of_step before the sync reads
    those answers without asking again. Answers from before a sync are void: every server that took it
    would be named out of step (and re-joined, and re-synced) on the strength of its old tag."""
    servers = [FakeServer(), FakeServer()]
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    syncer.sync(counting_params(), version=1)

    def asked(n: int) -> None:
        deadline = time.monotonic() + 5
        while any(s.tag_asks < n for s in servers):
            assert time.monotonic() < deadline, [s.tag_asks for s in servers]
            time.sleep(0.01)

    servers[1].version = "default"  # restarted while the trainer steps
    syncer.poll_ahead()
    asked(1)
    assert syncer.out_of_step() == [servers[1].url]
    assert [s.tag_asks for s in servers] == [1, 1]  # the answers asked ahead, not asked again
    servers[1].version = "1"
    syncer.poll_ahead()
    asked(2)
    syncer.sync(counting_params(), version=2)  # a sync before heal reads them: both now hold "2"
    assert syncer.out_of_step() == []
    assert [s.tag_asks for s in servers] == [3, 3]


def test_out_of_step_asks_every_server_at_once():
    """Each answer waits for a busy server's engine step: asked one after the other, heal would wait
    for them in turn. Here no server answers until all three have been asked; one at a time, the first
    would time out unanswered and the others would never be asked while it waited."""
    servers = [FakeServer() for _ in range(3)]
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    syncer.sync(counting_params(), version=1)
    barrier = threading.Barrier(len(servers), timeout=5)
    for s in servers:
        s.version, s.before_tag = "default", barrier.wait
    assert syncer.out_of_step() == [s.url for s in servers]


def test_a_failed_server_finishes_its_update_before_it_rejoins():
    """/start_weight_update timed out on our side but may have begun on the server's: unless it is
    finished, every later sync fails there ("already active")."""
    servers = [FakeServer(), FakeServer(fail=("/start_weight_update",))]
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    with pytest.raises(WeightSyncError):
        syncer.sync(counting_params(), version=1)
    servers[1].fail = ()
    syncer.join(syncer.out_of_step())
    last_start = max(i for i, c in enumerate(servers[1].calls) if c == "/start_weight_update")
    after = servers[1].calls[last_start:]
    assert "/finish_weight_update" in after
    assert after.index("/finish_weight_update") < after.index("/init_weight_transfer_engine"), after


def test_failed_servers_whose_engine_does_not_answer_are_aborted_side_by_side():
    """Servers that fail a sync but answer /health have their requests aborted; a server whose engine is
    stuck (NCCL: in the receive of a broadcast that timed out, every server of the communicator at once)
    answers /health but not /pause, which waits out http_timeout_s. One after another, the trainer
    waited that once per server (8 servers at the default 60 s: 8 minutes in the sync) before it could
    relaunch them."""
    servers = [FakeServer(fail=("/update_weights",)) for _ in range(4)]
    for s in servers:
        s.before_post = lambda path: time.sleep(8) if path.startswith("/pause") else None
    syncer, _ = fake_syncer("gloo", servers)  # http_timeout_s 5
    syncer.init()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="failed on 4 server"):
        syncer.sync(counting_params(), version=1)
    assert time.monotonic() - t0 < 12, f"{time.monotonic() - t0:.0f} s: the aborts were waited for in turn"
    assert all("/pause?mode=abort" in s.calls for s in servers)


def test_a_server_that_stays_asleep_fails_the_resume():
    """/wake_up?tags=scheduling on a server put to sleep at another level answers "sleeping": its
    requests would hang, so it fails the sync (in resume) instead of counting as resumed."""
    servers = [FakeServer(), FakeServer()]
    servers[1].sleeping = True
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    with pytest.raises(WeightSyncError, match=f"{servers[1].url} failed in resume"):
        syncer.sync(counting_params(), version=1)
    assert servers[1].url in syncer.failed and servers[0].url not in syncer.failed


def test_nccl_take_out_releases_the_communicator_and_rejoins_the_rest():
    """A server taken out of the run leaves the one communicator too: otherwise the next broadcast
    waits for it (300 s) and every survivor is marked stuck."""
    servers = [FakeServer(), FakeServer(), FakeServer()]
    syncer, comms = fake_syncer("nccl", servers)
    syncer.init()
    syncer.sync(counting_params(), version=1)
    syncer.take_out(servers[1].url, "out of step after a re-sync")
    assert comms[0].destroyed == 1 and comms[-1].members() == [servers[0], servers[2]]
    assert "/update_weight_version" in servers[1].calls and servers[1].url not in syncer.urls
    syncer.sync(counting_params(), version=2)  # the fake communicator refuses one over a non-member
    assert [s.version for s in servers] == ["2", "1", "2"] and syncer.failed == {}


def test_the_version_moves_before_the_per_sync_check_and_a_recheck_draws_a_new_seed(tmp_path):
    """The rollout process learns the new version as soon as the weights land (turns finishing during
    the check are on it); a server whose first check trips the bound is re-synced and checked with
    another seed, so the same bf16 noise does not take a healthy server out."""
    import train_async_grpo as T
    from fidelity import FidelityError, SyncChecks

    servers = [FakeServer()]
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    events = []
    args = SimpleNamespace(sync_every=1, fidelity_every=1, seed=7, max_steps=10)
    worker = SimpleNamespace(set_version=lambda v: events.append(("version", v)))

    def sample(url: str, bare: bool, seed: int = args.seed) -> dict:
        events.append(("sample", seed))
        return {"seed": seed}

    def verify(url: str, samples: dict) -> dict:
        if samples["seed"] == args.seed:  # this seed's draw lands beyond the bound
            raise FidelityError("max |Δ logprob| 2e-3")
        return {"fidelity/max_abs_diff": 1e-4}

    prober = SimpleNamespace(sample=sample, verify=verify, seed=args.seed, model=torch.nn.Linear(2, 2),
                             world_size=1)  # fmt: skip
    run = SimpleNamespace(args=args, step=1, version=0, servers=[], out_dir=tmp_path, syncer=syncer,
                          model=torch.nn.Linear(2, 2), world_size=1, worker=worker,
                          checks=SyncChecks(prober, syncer))  # fmt: skip
    (tmp_path / "vllm-logs").mkdir()
    T.sync_if_due(run)
    metrics = run.checks.finish()  # at the next step's update (SyncChecks.train)
    assert events[0] == ("version", 1), events
    assert [e for e in events if e[0] == "sample"] == [("sample", 7), ("sample", 8)], events
    assert syncer.taken_out == {} and metrics["fidelity/servers_resynced"] == 1.0


def test_one_server_re_synced_by_its_check_samples_for_training_again():
    """One server (the default set-up) whose check trips the bound once (bf16 noise) and passes after its
    re-sync: what it began before the re-sync is not trained and frees its admission slots, what it
    begins after is trained. (Both were dropped for as long as the version stayed 1, and with one server
    it stays 1 for ever: no step, no sync; the slots never freed, the run ended in BatchTimeout.)"""
    import train_async_grpo as T
    from fidelity import FidelityError, SyncChecks

    (server,) = servers = [FakeServer()]
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    model = torch.nn.Linear(2, 2)

    def verify(url: str, samples: dict) -> dict:
        if samples["seed"] == 0:  # the check's draw lands beyond the bound; the re-check's does not
            raise FidelityError("max |Δ logprob| 1.2e-3")
        return {"fidelity/max_abs_diff": 1e-5}

    prober = SimpleNamespace(sample=lambda url, bare, seed=0: {"seed": seed}, verify=verify, seed=0,
                             model=model, world_size=1)  # fmt: skip
    discarded = []
    run = SimpleNamespace(checks=SyncChecks(prober, syncer), worker=SimpleNamespace(discard=discarded.append),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    syncer.sync(model.named_parameters(), version=1)
    run.checks.start(1, 1)
    before = [_group(k, server.url, (1, 1), time.monotonic()) for k in range(2)]
    assert run.checks.finish()["fidelity/servers_resynced"] == 1.0  # at the previous batch's update
    after = _group(2, server.url, (1, 1), time.monotonic())
    assert T.train_on(run, before, None, torch.device("cpu")) == (None, [])
    assert discarded == [2], "their slots: replacements must be admitted"
    assert not run.checks.sampled_out_of_step(after)
    assert run.checks.logged()["fidelity/groups_dropped"] == 2.0 and syncer.taken_out == {}


def test_a_server_restarted_before_its_check_finishes_is_left_to_heal():
    """Killed right after a sync (its check's request fails) and restarted before the check finishes:
    no verdict, as for one still down; heal brings it back. (It was judged: a fresh server has no
    transfer group, its re-sync failed, and it was taken out for the rest of the run.)"""
    from fidelity import FidelityError, SyncChecks
    from vllm_server import healthy

    servers = [FakeServer(), FakeServer()]
    restarted = servers[1]
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    model = torch.nn.Linear(2, 2)
    syncer.sync(model.named_parameters(), version=1)

    def sample(url: str, bare: bool, seed: int = 0) -> dict:
        if not healthy(url):  # what fidelity.probe raises when its request fails
            raise FidelityError(f"fidelity probe: {url} did not return token ids (Connection refused)")
        return {}

    prober = SimpleNamespace(sample=sample, verify=lambda url, samples: {"fidelity/max_abs_diff": 0.0},
                             seed=0, model=model, world_size=1)  # fmt: skip
    checks = SyncChecks(prober, syncer)
    restarted.down_until = time.monotonic() + 3600  # down right after the sync
    checks.start(1, 1)
    checks.pending[2][restarted.url].exception()  # its request failed
    restarted.down_until, restarted.version, restarted.init_ports = 0.0, "default", []  # up again, fresh
    restarted.fail = ("/update_weights",)  # no transfer group: what a re-sync meets there
    checks.finish()
    assert syncer.taken_out == {} and syncer.out_of_step() == [restarted.url]


def _synced_pair_with_one_restarted(tmp_path, moved_since_sync: bool = True):
    """Two fake servers synced to version 1, the weights moved since (--sync-every 2) or not, the second
    restarted ("default", no group): (servers, syncer, comms, model, heal's run)."""
    servers = [FakeServer(), FakeServer()]
    syncer, comms = fake_syncer("gloo", servers)
    syncer.init()
    model = torch.nn.Linear(2, 2)
    syncer.sync(model.named_parameters(), version=1)
    (tmp_path / "vllm-logs").mkdir()
    run = SimpleNamespace(servers=[], out_dir=tmp_path, syncer=syncer, model=model, version=1, world_size=1,
                          moved_since_sync=moved_since_sync)  # fmt: skip
    servers[1].version, servers[1].init_ports = "default", []  # restarted
    return servers, syncer, comms, model, run


def test_heal_gives_a_restarted_server_the_next_sync_once_an_update_moved_the_weights(tmp_path):
    """--sync-every 2: between two syncs the weights move. A server restarted then rejoins and gets the
    next sync, not the moved weights under the last sync's tag (two servers saying version 1 while
    holding different weights); with the weights as synced, heal gives them at once."""
    import train_async_grpo as T

    servers, syncer, _, model, run = _synced_pair_with_one_restarted(tmp_path)
    T.heal(run)
    assert [s.version for s in servers] == ["1", "default"] and servers[1].url in syncer.groups
    syncer.sync(model.named_parameters(), version=2)  # the next sync reaches it
    assert [s.version for s in servers] == ["2", "2"]
    run.version, run.moved_since_sync = 2, False
    servers[0].version, servers[0].init_ports = "default", []
    T.heal(run)
    assert [s.version for s in servers] == ["2", "2"]


def test_the_eval_goes_to_the_servers_still_in_the_run(tmp_path, monkeypatch):
    """A server the per-sync check took out is paused (`/pause?mode=abort`): an eval request there waits
    its whole timeout (--batch-timeout, 600 s) and its row counts as failed. The eval asks the others."""
    import train_async_grpo as T

    servers = [FakeServer(), FakeServer()]
    syncer, _ = fake_syncer("gloo", servers)
    syncer.init()
    syncer.sync(torch.nn.Linear(2, 2).named_parameters(), version=1)
    syncer.take_out(servers[1].url, "still out of step after a re-sync")
    asked = []

    async def evaluate(urls, *rest) -> dict:
        asked.append(urls)
        return {}

    monkeypatch.setattr(T, "evaluate", evaluate)
    (tmp_path / "vllm-logs").mkdir()
    run = SimpleNamespace(servers=[], out_dir=tmp_path, syncer=syncer, t_last=0.0, request_s=0.0,
                          worker=SimpleNamespace(stats=SimpleNamespace(request_seconds=0.0)))  # fmt: skip
    T.evaluate_now(run, ("model", "template", "make_episode", [], "args", "expected_version"))
    assert asked == [[servers[0].url]]


def test_the_requests_in_flight_during_an_eval_are_not_the_next_steps(monkeypatch):
    """Rollouts go on during an --eval-every eval, whose seconds are taken out of the next step's
    perf/step_s; their seconds in flight are taken out of it too, or perf/requests_in_flight, their mean
    over the step, counted the eval's (4 in flight, a 1 s eval, a 0.25 s step: 19.9 instead of 4)."""
    import train_async_grpo as T
    from records import group_metrics

    t0 = time.monotonic()

    class Stats:  # the rollout worker's: 4 requests always in flight
        groups_failed = groups_retried = 0
        request_seconds = property(lambda self: 4 * (time.monotonic() - t0))

    stats = Stats()

    async def evaluate(*args) -> dict:
        await asyncio.sleep(1.0)
        return {}

    monkeypatch.setattr(T, "evaluate", evaluate)
    monkeypatch.setattr(T, "heal", lambda run: None)
    run = SimpleNamespace(step=1, version=1, position=SimpleNamespace(frontier=0, pending=[]),
                          worker=SimpleNamespace(stats=stats, client=SimpleNamespace(down=set())),
                          syncer=SimpleNamespace(urls=[]), t_last=t0, request_s=0.0)  # fmt: skip
    T.evaluate_now(run, ())
    time.sleep(0.25)  # the step after it, on one group
    group = _group(0, "http://server", (1, 1))
    group.staleness, group.metrics = 0, group_metrics(group.completions)
    metrics = T.step_metrics(run, [group], ([group], 0, 0), 1, [{"ids": [1, 5]}], 0.0, 0.1)
    assert metrics["perf/requests_in_flight"] == pytest.approx(4.0, rel=0.1)


def test_gloo_join_keeps_the_servers_that_joined_and_leaks_no_store():
    """One server answers /get_world_size but cannot join (its init fails): the others keep their group
    (they were dropped with it), and a heal retrying it at every call keeps one store per joined group
    (each attempt leaked the stores, sockets and threads of the groups formed before the failure)."""
    servers = [FakeServer(), FakeServer(fail=("/init_weight_transfer_engine",))]
    syncer, comms = fake_syncer("gloo", servers)

    def join(port, world_size):  # as gloo_group: completes only if a server dialed `port`
        deadline = time.monotonic() + 2
        while not any(s.init_ports and s.init_ports[-1] == port for s in servers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nobody joined on port {port}")
            time.sleep(0.01)
        comms.append(object())
        syncer.stores[comms[-1]] = object()  # the real _join keeps the group's TCPStore here
        return comms[-1]

    syncer._join = join
    for _ in range(3):
        with pytest.raises(WeightSyncError, match=servers[1].url):
            syncer.join(syncer.urls)
    assert list(syncer.groups) == [servers[0].url]
    assert len(syncer.stores) == 1


def test_a_failed_update_leaves_the_server_serving_its_old_weights(server_a):
    """/update_weights failing before the receive (no group on the server: restarted or shut down; an
    update_info it cannot parse; lists of unequal length, which loaded a subset silently under the new
    tag) puts the layers back as a failed transfer does: they were left on meta tensors, and the engine
    died once woken."""
    model = load_trainer_model("tiny")
    perturb(model, seed=21)
    syncer = WeightSyncer([server_a.url], http_timeout_s=20, transfer_timeout_s=20)
    syncer.init()
    syncer.sync(model.named_parameters(), version=21)
    weight_sync.post(server_a.url, "/shutdown_weight_transfer_engine", None, 20)
    with pytest.raises(WeightSyncError, match=server_a.url):
        syncer.sync(model.named_parameters(), version=22)
    for bad in ({"names": [], "bogus": 1}, {"names": ["x"], "dtype_names": [], "shapes": []}):
        for path in ("/sleep?level=0&mode=keep", "/start_weight_update"):
            weight_sync.post(server_a.url, path, None, 20)
        with pytest.raises(weight_sync.HTTPStatusError, match="update_info"):
            weight_sync.post(server_a.url, "/update_weights", {"update_info": bad}, 20)
    weight_sync.post(server_a.url, "/wake_up?tags=scheduling", None, 20)
    assert max_diff(model, server_a.url) < TOL and weight_version(server_a.url) == "21"  # serves, old weights
    syncer.join([server_a.url])
    syncer.sync(model.named_parameters(), version=22)
    syncer.close()


def test_a_payload_the_server_rejects_fails_at_once_with_its_own_error(server_a):
    """A tensor the model has no parameter for, in a model larger than bucket_bytes: the sync fails in
    seconds naming the server's error (the server leaves its group), not after transfer_timeout_s with a
    broadcast timeout, at every heal while the cause lasts."""
    model = load_trainer_model("tiny")
    syncer = WeightSyncer([server_a.url], http_timeout_s=20, transfer_timeout_s=60, bucket_bytes=128 * 1024)
    syncer.init()
    params = list(model.named_parameters())
    params.insert(3, ("model.layers.0.bogus.weight", torch.zeros(8)))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="no module or parameter named 'layers.0.bogus'"):
        syncer.sync(params, version=31)
    assert time.monotonic() - t0 < 15
    syncer.join([server_a.url])
    syncer.sync(model.named_parameters(), version=31)
    assert max_diff(model, server_a.url) < TOL
    syncer.close()


def test_nccl_join_that_one_server_refuses_keeps_no_communicator():
    """nccl: one communicator spans every server, so when one of them reports an init error none keeps
    it (a sync over it would wait on the failed one) and it is destroyed."""
    servers = [FakeServer(), FakeServer(fail=("/init_weight_transfer_engine",))]
    syncer, comms = fake_syncer("nccl", servers)
    with pytest.raises(WeightSyncError, match="init failed: " + servers[1].url):
        syncer.join(syncer.urls)
    assert syncer.groups == {} and [c.destroyed for c in comms] == [1]


def test_a_server_that_joined_is_not_joined_again_while_it_waits_for_the_next_sync(tmp_path, capsys):
    """--sync-every 2: a restarted server that joined between two syncs still reports "default" (its
    weights come with the next sync). It was joined again at every heal (every 5 s while the trainer
    waits for a batch, with a new group each time and a line on stderr each time); now once."""
    import train_async_grpo as T

    servers, syncer, comms, model, run = _synced_pair_with_one_restarted(tmp_path)
    for _ in range(5):
        T.heal(run)
    assert servers[1].calls.count("/init_weight_transfer_engine") == 2  # init(), then one heal
    assert capsys.readouterr().err.count("new weight-transfer group") == 1
    syncer.sync(model.named_parameters(), version=2)  # the next sync reaches it
    assert [s.version for s in servers] == ["2", "2"]
    T.heal(run)
    assert servers[1].calls.count("/init_weight_transfer_engine") == 2 and len(comms) == 3


def syncer_clock_ahead(monkeypatch) -> list[float]:
    """weight_sync's monotonic clock, ahead of the real one by the returned list's one value (seconds,
    0 at first): a test moves it to pass heal's backoff waits in no time."""
    skew = [0.0]
    clock = {n: getattr(time, n) for n in dir(time) if not n.startswith("_")}
    monkeypatch.setattr(
        weight_sync, "time", SimpleNamespace(**clock | {"monotonic": lambda: time.monotonic() + skew[0]})
    )
    return skew


def test_a_server_that_fails_to_join_is_retried_with_a_doubling_backoff_and_named_once(
    tmp_path, capsys, monkeypatch
):
    """A server that answers but cannot join (its /init_weight_transfer_engine fails) was tried again at
    every heal (every 5 s while the trainer waits for a batch), each try naming it on stderr again. Now:
    the first try at once, then after 10 s, 20 s, 40 s, … up to 120 s, one line when it starts failing;
    once it joins, heal names it. The syncer's clock runs 2 s a heal here."""
    import train_async_grpo as T

    servers = [FakeServer(), FakeServer(fail=("/init_weight_transfer_engine",))]
    syncer, _ = fake_syncer("gloo", servers)
    with pytest.raises(WeightSyncError):
        syncer.init()
    model = torch.nn.Linear(2, 2)
    syncer.sync(model.named_parameters(), version=1)
    (tmp_path / "vllm-logs").mkdir()
    run = SimpleNamespace(servers=[], out_dir=tmp_path, syncer=syncer, model=model, version=1, world_size=1,
                          moved_since_sync=False)  # fmt: skip
    skew = syncer_clock_ahead(monkeypatch)
    tries = []
    servers[1].before_post = lambda path: path.startswith("/init") and tries.append(skew[0])
    while skew[0] < 400:  # heal called again and again, as in an outage
        T.heal(run)
        skew[0] += 2
    assert [b - a for a, b in zip(tries, tries[1:])] == [10, 20, 40, 80, 120, 120], tries
    err = capsys.readouterr().err
    assert err.count(servers[1].url) == 1 and "HTTP 500" in err, err
    servers[1].fail = ()  # fixed: it joins at its next try and gets the current weights
    while servers[1].version != "1":
        assert skew[0] < 600
        T.heal(run)
        skew[0] += 2
    assert f"{servers[1].url}: new weight-transfer group, gets model version 1" in capsys.readouterr().err
    assert syncer.retry == {} and syncer.awaiting == set() and syncer.join_failing == set()


def test_a_server_that_refuses_to_join_costs_its_answer_not_the_transfer_timeout():
    """A server whose /init_weight_transfer_engine answers an error at once never dials the group, but
    the trainer waited for it in the real gloo rendezvous for the whole transfer timeout (20 s here;
    300 s by default, at every heal). Now its answer ends the wait: the server that joins keeps its
    group, the one that refused is named with its own error, in well under the timeout. Nor is the
    refused rendezvous left waiting on its thread: it woke at its timeout, and when the process was
    exiting by then (this test ended the CI's pytest session) it aborted ("terminate called without an
    active exception", exit 134); the trainer now dials it in the refusing server's place."""
    kept = []  # the joined worker's (store, group): they must outlive the test's join
    servers = [FakeServer(), FakeServer(fail=("/init_weight_transfer_engine",))]
    servers[0].on_init = lambda info: kept.append(  # as the gloo worker engine: rank 1, answers once joined
        weight_sync.gloo_group(info["master_address"], info["master_port"], 1, info["world_size"], 20)
    )
    syncer = WeightSyncer([s.url for s in servers], backend="gloo", http_timeout_s=5, transfer_timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"{servers[1].url}.*HTTP 500") as e:
        syncer.init()
    seconds = time.monotonic() - t0
    print(f"join with one server refusing: {seconds:.2f} s")
    assert seconds < 5, (seconds, e.value)
    assert list(syncer.groups) == [servers[0].url] and len(kept) == 1
    deadline = time.monotonic() + 5
    while (waiting := [t.name for t in threading.enumerate() if t.name.startswith("weight-sync")]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert waiting == [] and len(syncer.stores) == 1  # the refused group formed and was released
