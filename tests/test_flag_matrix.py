"""The options researchers combine, run together through the real trainer: 2-3 real steps per case on
real vLLM servers (the session's server of the case's model, tiny-warm or tiny-warm2, and one of the
module's own beside it in the two-server cases; every case pushes its own weights in at start; a LoRA
case runs on the module's own servers, started with LoRA on), every pair of options together in at
least one case.

The options (each on or off in a case):
  T  truncation: --top-k 20 --top-p 0.9
  M  --mini-batches 2
  Z  non-binary rewards (tests/matrix_env.py: wrong −0.9, +0.01 per tool call), G = 3: equal ones −0.9, −0.89
  S  --loss-norm sequence
  K  KL to the reference: --kl-beta 0.05
  Y  --sync-every 2 with --max-staleness 2
  V  two servers
  F  two FSDP ranks (torchrun, gloo)
  Q  the Qwen3-thinking model (tiny-warm2, the official template) with --max-calls-per-turn 2
  R  resume from an earlier case's checkpoint (of the same model, and LoRA's if L is on)
  L  a LoRA adapter: --lora-rank 8 (adapter-only syncs)
and --compile on in one case (COMPILED). --keep-zero-variance is on in every case: the tiny models'
groups mostly have equal rewards, and without it batches would rarely come (their exact zero
advantages are checked under Z). Weight decay makes every step move the weights.

For every case: each step's loss and gradient norm finite, no non-finite step, the weights moved, each
sync's round-trip fidelity check within the bound and no server re-joined, the first step's trainer
logprobs equal vLLM's on every trained token (the servers hold the trainer's weights then), no group
failed or dropped, the metrics present, AdamW's step count and the model version carried on (across a
resume too); what each option on in the case must show; and the checks tests/matrix_env.py makes inside
the run (every loss against a plain loop, the ranks' token count, the first step's truncation, equal
rewards' advantages). README's matrix section lists the defect each option was seen to catch.
"""

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import START_TIMEOUT, push_weights, start_server
from safetensors.torch import load_file

from checkpoint import param_checksum
from tests.matrix_env import CHECKS
from vllm_server import VLLMServer, free_port

REPO = Path(__file__).resolve().parent.parent
OPTIONS = "TMZSKYVFQRL"
# A covering array of strength 2: each column of TMZSKYVFQR is a 3-subset of cases 1-5 (case 0 has every
# option off), so any two of them are both on in some case, both off in case 0, and each on without the
# other. Ten is the most 6 cases hold (3-subsets of 5); L takes case 6 (with S alone: on without each
# other option but S, which is off in cases 1 and 4) and cases 1 and 4 (with every option but S).
CASES = ["", "QFTMZKL", "QVTMSY", "RFVTKS", "QRVZKYL", "RFMZSY", "LS"]
RESUME_FROM = {3: 0, 4: 1, 5: 0}  # a checkpoint of the same model, LoRA's for a LoRA case
ORDER = [0, 6, 3, 5, 1, 2, 4]  # by model (one server set at a time), each resume after its source
LORA_RANK, LORA_SLOTS = 8, 4  # slots: --max-staleness 2 + 2, what a launched server gets
FLAGS = {
    "T": ["--top-k", "20", "--top-p", "0.9"],
    "M": ["--mini-batches", "2"],
    "Z": ["--env", "retool_shaped"],
    "S": ["--loss-norm", "sequence"],
    "K": ["--kl-beta", "0.05"],
    "Y": ["--sync-every", "2", "--max-staleness", "2"],
    "Q": ["--chat-template", str(REPO / "tests" / "templates" / "qwen3.jinja"), "--max-calls-per-turn", "2"],
    "L": ["--lora-rank", str(LORA_RANK)],
}  # fmt: skip
FP32_MAX_ABS_DIFF = 1e-3  # fidelity.py's fp32 bound; measured ~1e-5
# Cases that also run with --compile on (decoder layers and logprob head through inductor). Not an option
# of the array: on CUDA it is on by default, so there it meets every option; here the case with the most
# on (FSDP ranks, LoRA, the KL reference, truncation, mini-batches, Qwen3), for ~20 s of inductor a rank.
COMPILED = {1}


def test_the_cases_cover_every_pair_of_options():
    for a, b in itertools.combinations(OPTIONS, 2):
        seen = {(a in case, b in case) for case in CASES}
        every = {(True, True), (True, False), (False, True), (False, False)}
        assert seen == every, (a, b)
    for case, source in RESUME_FROM.items():
        assert "R" in CASES[case] and "R" not in CASES[source]
        for same in "QL":  # the same model; a LoRA checkpoint (the adapter alone) for a LoRA case only
            assert (same in CASES[case]) == (same in CASES[source])
        assert ORDER.index(source) < ORDER.index(case)
    assert sorted(ORDER) == list(range(len(CASES)))
    assert ["Q" in CASES[c] for c in ORDER] == sorted("Q" in CASES[c] for c in ORDER)  # one switch of model


class MatrixServers:
    """The session's server of a case's model (tiny-warm2's vocabulary, its <think> tokens, is not
    tiny-warm's: a server takes the weights of its own model only) and, for the two-server cases, one of
    the module's own beside it (seed 1). The cases run grouped by model (ORDER): the module's own servers
    are replaced once, and start as the first case of their model begins, so their start-up overlaps
    that case's run. A model with LoRA cases gets its own servers with LoRA on (the session's have it
    off), two where a LoRA case has two servers; a LoRA case runs on them alone. A LoRA run sends no
    base weights, so before one its servers get the model's own weights back where a full fine-tuning
    case trained into them (the adapters an earlier LoRA case left loaded, its `v{n}` names, the trainer
    unloads at start: lora.AdapterSyncer.init)."""

    def __init__(self, shared: dict[str, VLLMServer], log_dir: Path):
        self.shared, self.log_dir, self.own, self.own_model = shared, log_dir, [], None
        self.trained: set[str] = set()  # own servers a full fine-tuning case pushed its weights into

    def urls(self, model: Path, two: bool, lora_case: bool) -> list[str]:
        if self.own_model != model:
            self.stop()
            options = [CASES[c] for c in range(len(CASES)) if _model(c) == model]
            lora_on = any("L" in o for o in options)
            n = 2 if any("L" in o and "V" in o for o in options) else 1
            self.own = [
                start_server(str(model), log_dir=self.log_dir, seed=1 + k, wait=False,
                                  lora_rank=LORA_RANK if lora_on else 0, lora_slots=LORA_SLOTS)
                for k in range(n)
            ]  # fmt: skip
            self.own_model = model
        if lora_case:
            own = self.own[: 2 if two else 1]
            for server in own:
                server.wait_healthy(START_TIMEOUT)
                if server.url in self.trained:
                    push_weights(server.url, model)
                    self.trained.discard(server.url)
            return [s.url for s in own]
        if not two:
            return [self.shared[model.name].url]
        self.own[0].wait_healthy(START_TIMEOUT)
        self.trained.add(self.own[0].url)
        return [self.shared[model.name].url, self.own[0].url]

    def stop(self) -> None:
        for server in self.own:
            server.stop()
        self.own, self.own_model, self.trained = [], None, set()


@pytest.fixture(scope="module")
def servers(trainer_server, warm2_server, tmp_path_factory):
    pair = MatrixServers(
        {"tiny-warm": trainer_server, "tiny-warm2": warm2_server}, tmp_path_factory.mktemp("matrix-vllm")
    )
    yield pair
    pair.stop()


RUNS: dict[int, Path] = {}  # case → its output dir, for the cases that resume from it


def _model(case: int) -> Path:
    return REPO / "models" / ("tiny-warm2" if "Q" in CASES[case] else "tiny-warm")


def _command(case: int, out: Path, urls: list[str]) -> tuple[list[str], int]:  # one URL, or two (V)
    options = CASES[case]
    steps = 3 if "Y" in options else 2
    args = ["--model", str(_model(case)), "--env", "retool"]
    for o in options:
        args += FLAGS.get(o, [])
    start = 0
    if "R" in options:
        source = RUNS.get(RESUME_FROM[case])
        assert source is not None, f"case {RESUME_FROM[case]} (the checkpoint to resume from) did not run"
        ckpt = sorted((source / "checkpoints").glob("step_*"))[-1]
        args += ["--resume", str(ckpt)]
        start = int(ckpt.name.split("_")[1])
    for url in urls:
        args += ["--vllm-url", url]
    if case in COMPILED:
        args += ["--compile", "on"]
    args += [
        "--output-dir", str(out), "--max-steps", str(start + steps), "--prompts-per-step", "2",
        "--num-generations", "3" if "Z" in options else "4", "--max-context", "512", "--max-turns", "3",
        "--keep-zero-variance",
        "--lr", "1e-3", "--weight-decay", "0.1", "--log-completions-every", "1", "--sandbox-workers", "2",
        "--batch-timeout", "240", "--save-every", "1000", "--micro-batch-tokens", "1024",
    ]  # fmt: skip
    launcher = [sys.executable]
    if "F" in options:
        launcher += [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
        ]
    return launcher + [str(REPO / "tests" / "matrix_env.py"), *args], start


def _checksum(model_dir: Path) -> float:
    """Of the weights trained: the model's, or a LoRA checkpoint's adapter alone."""
    if (model_dir / "adapter_model.safetensors").exists():
        return param_checksum(load_file(model_dir / "adapter_model.safetensors").items())
    return param_checksum(load_file(model_dir / "model.safetensors").items())


@pytest.mark.parametrize("case", ORDER, ids=lambda c: f"{c}-{CASES[c] or 'plain'}")
def test_flag_matrix(case, servers, tmp_path):
    options = CASES[case]
    out = tmp_path / "run"
    cmd, start = _command(case, out, servers.urls(_model(case), two="V" in options, lora_case="L" in options))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(tmp_path / "stdout.log", "w") as stdout, open(tmp_path / "stderr.log", "w") as stderr:
        code = subprocess.run(cmd, cwd=REPO, stdout=stdout, stderr=stderr, timeout=900, env=env).returncode
    r = SimpleNamespace(
        stdout=(tmp_path / "stdout.log").read_text(), stderr=(tmp_path / "stderr.log").read_text()
    )
    log = r.stdout[-4000:] + r.stderr[-6000:]
    assert code == 0, log
    RUNS[case] = out
    assert f"compiled decoder layers and logprob head: {'on' if case in COMPILED else 'off'} (" in r.stdout
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m["step"] > start]
    assert [m["step"] for m in steps] == list(range(start + 1, start + 1 + len(steps))) and steps, log

    # Every step: finite, nothing dropped or failed, the metrics there.
    for m in steps:
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/mismatch_kl", "train/kl_ref"):
            assert math.isfinite(m[key]), (key, m)
        assert m["train/nonfinite_steps"] == 0, m
        assert m["rollout/dropped_stale"] == 0 and m["perf/groups_failed"] == 0, m
        assert m["train/optimizer_steps"] == (2 if "M" in options else 1)
        if "K" not in options:
            assert m["train/kl_ref"] == 0, m
    # K: the reference is a model of its own. A fresh run starts at it (LoRA: B = 0, the same model
    # exactly), so k3 is 0 until an optimizer step has moved the weights: a step with a gradient (with
    # --mini-batches, one whose first mini-batch had no non-zero advantage moved nothing).
    if "K" in options:
        moved = "R" in options
        for m in steps:
            assert m["train/kl_ref"] > 0 if moved else m["train/kl_ref"] >= 0, m
            moved = moved or m["train/grad_norm"] > 0
    # Every sync: the round-trip check ran on every server and found it in step. It runs beside the next
    # step and lands on that step's line (the first line: the start-up probe's).
    syncs = [m for m in steps if m["sync/seconds"] > 0]
    every = 2 if "Y" in options else 1
    assert [m["step"] for m in syncs] == [m["step"] for m in steps if m["step"] % every == 0], steps
    for m in [m for m in steps if m is steps[0] or (m["step"] - 1) % every == 0]:
        assert m["fidelity/seconds"] > 0 and m["fidelity/max_abs_diff"] <= FP32_MAX_ABS_DIFF, m
        assert m["fidelity/servers_out"] == 0 and m["fidelity/servers_resynced"] == 0, m
    counters = [ln for ln in r.stderr.splitlines() if ln.startswith("rollout counters:")]
    assert counters and "failed 0," in counters[-1], counters

    # The weights moved: the final checkpoint is not the one the run started from (LoRA: the adapter
    # is not the checkpoint's, nor a fresh one, whose B is zero).
    final = sorted((out / "checkpoints").glob("step_*"))[-1]
    assert final.name == f"step_{start + len(steps):06d}"
    if "R" in options:
        before = sorted((RUNS[RESUME_FROM[case]] / "checkpoints").glob("step_*"))[-1]
    else:
        before = _model(case)
    if "L" in options:
        adapter = load_file(final / "adapter_model.safetensors")
        assert (
            not (final / "model.safetensors").exists()
            and max(t.abs().max().item() for k, t in adapter.items() if "lora_B" in k) > 0
        ), "the adapter did not move"
        if "R" not in options:
            before = None
    if before is not None:
        assert _checksum(final) != pytest.approx(_checksum(before), rel=1e-9)
    # LoRA: every sync loaded the adapter alone (no weights sent); full fine-tuning: never an adapter.
    assert [m.get("sync/adapter", 0.0) for m in syncs] == [1.0 if "L" in options else 0.0] * len(syncs), syncs
    if "R" in options:
        resumed = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("resumed from")]
        assert resumed and f"at step {start}," in resumed[0], resumed

    # The first step's completions were sampled with the weights the trainer holds: its logprobs equal
    # vLLM's on every trained token (truncation, thinking template and parallel calls included).
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    rows = [x for x in rows if x["step"] > start]
    first = [x for x in rows if x["step"] == start + 1]
    gaps = []
    for x in first:
        tokens = x["tokens"]
        gaps += [
            abs(p - b)
            for p, b, on in zip(tokens["trainer_logprob"], tokens["behaviour_logprob"], tokens["mask"])
            if on
        ]
    assert gaps and max(gaps) <= FP32_MAX_ABS_DIFF, max(gaps or [0])

    # What each option must show.
    by_group: dict[tuple, list] = {}
    for x in rows:
        by_group.setdefault((x["step"], x["row_index"]), []).append(x)
    equal_groups = [g for g in by_group.values() if len(g) == 2 and g[0]["reward"] == g[1]["reward"]]
    assert all(x["advantage"] == 0.0 for g in equal_groups for x in g), equal_groups
    rewards = {x["reward"] for x in rows}
    if "Z" in options:
        # the shaped rewards are there; every group of equal ones (−0.9 × 3, …: most runs have some, not
        # every run) has exactly zero advantages (matrix_env's check); test_loss.py pins it for any float
        assert rewards - {0.0, 1.0}, rewards
    else:
        assert rewards <= {0.0, 1.0}, rewards
    if "Q" in options:
        texts = "".join(x["text"] for x in rows)
        assert "<think>" in texts
        # the model is left to think: the prompt ends at the assistant header, no empty block closed for it
        prompts = [x["text"][: len(x["text"]) - len("".join(x["tokens"]["pieces"]))] for x in rows]
        assert not [p for p in prompts if "</think>" in p], prompts[0][-200:]
        calls_per_turn = [len([c for c in x["tool_calls"] if c["turn"] == t]) for x in rows for t in range(3)]
        assert max(calls_per_turn) <= 2, calls_per_turn
        if (
            "R" not in options
        ):  # tiny-warm2 makes two calls a tool turn; a checkpoint trained at lr 1e-3 may not
            assert 2 in calls_per_turn, calls_per_turn
    if "Y" in options:
        staleness = [m["rollout/staleness_max"] for m in steps]
        assert max(staleness) <= 2, staleness

    # The optimizer state went on from the checkpoint (AdamW's step count) and so did the model version.
    state = lambda ckpt: torch.load(ckpt / "trainer_state.pt", weights_only=False)  # noqa: E731
    adam_steps = lambda ckpt: {float(v["step"]) for v in state(ckpt)["optimizer"]["state"].values()}  # noqa: E731
    n_adam, v0 = len(steps) * (2 if "M" in options else 1), 0
    if "R" in options:
        (n_before,) = adam_steps(before)
        n_adam += n_before
        source = state(before)
        v0, pending = source["model_version"], set(source["pending_rows"])
        # no row it had admitted and not trained is lost: each is trained now or still pending at the end
        # (a resume admits them first, but in an async run they need not finish first: a fresh-clone run
        # trained 6 later rows before either of its 2; test_resume.py pins the order at staleness 0); no
        # row below its frontier is read again
        trained = {i for m in steps for i in m["trained_rows"]}
        final_pending = set(state(final)["pending_rows"])
        assert pending <= trained | final_pending, (trained, pending, final_pending)
        below = {i for i in trained if i < source["dataset_position"]}
        assert below <= pending, (below, pending)
    assert adam_steps(final) == {n_adam}, (adam_steps(final), n_adam)
    assert [m["model_version"] for m in steps] == [v0 + m["step"] // every - start // every for m in steps]

    # Every server took every sync: none had to be found without the trainer's weights and re-joined
    # (a sync that skips a server leaves it behind; the run heals it, or routes around it, and goes on).
    healed = [ln for ln in r.stderr.splitlines() if "new weight-transfer group" in ln]
    assert not healed and "taken out 0, back 0" in counters[-1], (healed, counters)

    # Checked inside the run (tests/matrix_env.py): every loss against a plain loop with the options given,
    # the ranks' token count, the first step's truncation, equal rewards' advantages.
    checks = [json.loads(x) for x in (out / CHECKS).read_text().splitlines()]
    assert not [c for c in checks if not c["ok"]], [c for c in checks if not c["ok"]][:3]
    losses = [c for c in checks if c["check"] == "loss"]
    assert losses and len([c for c in checks if c["check"] == "tokens"]) == len(steps), checks[-3:]
    sized = [c for c in losses if c["lengths_differ"] and max(abs(c["expected"]), abs(c["other"])) > 1e-4]
    if "S" in options and "Q" not in options and sized:
        # tiny-warm's sequences differ in length (tiny-warm2's mostly fill the context): a token mean and
        # a mean of sequence means differ where a micro-batch holds sequences of different lengths with an
        # advantage (case 6 once had only one such sequence per micro-batch), unless every loss is ~0
        # under both (a run of only equal-reward groups, met in case 5 by two fresh-clone runs: its losses
        # were 0 but for float noise; on-policy, the sequence norm's loss is 0 for any complete group)
        assert any(c["discriminates"] for c in sized), [(c["expected"], c["other"]) for c in losses]
    (first_step,) = [c for c in checks if c["check"] == "truncation"]
    if "T" in options:  # renormalised over the kept set: some trained token's logprob was raised
        assert first_step["max_raise"] > 1e-2, first_step
    else:
        assert first_step["max_abs"] <= FP32_MAX_ABS_DIFF, first_step
