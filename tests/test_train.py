"""The trainer: packing against one-sequence-at-a-time logprobs, the batch-wait timeout's explanation, the
resumable row stream, argument checks, and the real pipeline end to end (a subprocess with its own vLLM
server and weight sync: a few steps, kill -9, --resume at the same step)."""

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import wait_for
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import train_async_grpo as T
import trainer
from batches import BatchTimeout, collate, collect_groups, pack, row_stream
from checkpoint import param_checksum
from distributed import describe_plan, init_distributed, plan_devices, shard_model
from envs import load_env
from envs.data import load_rows
from envs.sandbox import isolation_mode
from metrics import open_jsonl, rollout_metrics
from records import RolloutCompletion, RolloutGroup, TurnRecord, group_metrics
from rollout import ClientStats, WorkerStats
from sampling import Sampling, token_logprobs
from vllm_server import group_pids

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------
# PACKING
# ---------------------------------------------------------------------------------------------------
def _seq(prompt_len: int, completion_len: int, gen: torch.Generator) -> dict:
    n = prompt_len + completion_len
    return {
        "ids": torch.randint(0, 500, (n,), generator=gen).tolist(),
        "mask": [0] * prompt_len + [1] * completion_len,
        "behaviour": [0.0] * n,
        "advantage": 1.0,
    }


def test_packed_logprobs_equal_per_sequence_logprobs(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [_seq(5, 9, gen), _seq(3, 4, gen), _seq(7, 12, gen)]
    mb = collate(seqs, "cpu")
    assert mb["position_ids"][0].tolist() == [*range(14), *range(7), *range(19)]
    with torch.no_grad():
        packed, entropy = token_logprobs(
            model, mb["input_ids"], mb["position_ids"], Sampling(0.7), with_entropy=True
        )
        alone = []
        for s in seqs:
            ids = torch.tensor(s["ids"])[None]
            lp, _ = token_logprobs(model, ids, torch.arange(ids.shape[1])[None], Sampling(0.7))
            # Reference without our helper: plain forward, no position_ids, log_softmax at temperature.
            logits = model(ids).logits[0, :-1] / 0.7
            ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            torch.testing.assert_close(lp[1:], ref, atol=1e-5, rtol=1e-5)
            alone.append(lp)
    mask = mb["loss_mask"].bool()  # every sequence's first token (a prompt token) is masked out
    torch.testing.assert_close(packed[mask], torch.cat(alone)[mask], atol=1e-5, rtol=1e-5)
    assert entropy.shape == packed.shape and (entropy[mask] > 0).all()


def test_pack_respects_the_token_budget():
    lens = [100, 30, 70, 250, 10, 60]
    seqs = [{"ids": [0] * n} for n in lens]
    bins = pack(seqs, budget=128)
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    for b in bins:
        assert sum(lens[i] for i in b) <= 128 or len(b) == 1  # an over-long sequence goes alone


# ---------------------------------------------------------------------------------------------------
# BATCH WAIT
# ---------------------------------------------------------------------------------------------------
def _fake_worker(alive: bool, groups=(), **stats):
    q = queue.Queue()
    for g in groups:
        q.put(g)
    return SimpleNamespace(
        queue=q, alive=alive, exhausted=False, stats=WorkerStats(**stats),
        client=SimpleNamespace(stats=ClientStats(), down=set()), discard=lambda n=1: None,
    )  # fmt: skip


def _args(drop_stale: bool = False, **kw):
    """The real parser's defaults (a default that changed, e.g. --drop-stale on, must fail the tests that
    rely on it), with a short batch timeout."""
    args = T.parser.parse_args(["--model", "m", "--batch-timeout", "1"] + ["--drop-stale"] * drop_stale)
    return SimpleNamespace(**vars(args) | kw)


def test_batch_timeout_names_a_dead_worker_and_a_down_server():
    worker = _fake_worker(alive=False, groups_started=3, groups_failed=3, last_error="GenerationError: boom")
    with pytest.raises(BatchTimeout) as e:
        collect_groups(worker, 2, 0, _args(), ["http://127.0.0.1:9"], {"stop": False})
    msg = str(e.value)
    assert "rollout worker died" in msg
    assert "not healthy: http://127.0.0.1:9" in msg
    assert "GenerationError: boom" in msg and "0/2 groups" in msg


def test_batch_timeout_names_a_server_kept_out_of_routing():
    worker = _fake_worker(alive=True)
    worker.client.down = {"http://127.0.0.1:7"}  # answers /health, but never re-synced
    with pytest.raises(BatchTimeout) as e:
        collect_groups(worker, 1, 0, _args(), [], {"stop": False})
    assert "answer but are out of routing: http://127.0.0.1:7" in str(e.value)


def test_batch_timeout_says_all_rewards_were_equal_and_stale_groups_are_dropped():
    equal = SimpleNamespace(rewards=[0.0] * 4, admitted_version=0, row={"_index": 0})
    stale = SimpleNamespace(rewards=[0.0, 1.0], admitted_version=0, row={"_index": 1})
    worker = _fake_worker(alive=True, groups=[equal] * 3, groups_started=3, groups_done=3)
    t0 = time.monotonic()
    with pytest.raises(BatchTimeout) as e:
        collect_groups(worker, 1, 0, _args(), [], {"stop": False})
    assert time.monotonic() - t0 < 10
    assert "all rewards equal in 3 groups" in str(e.value)
    worker = _fake_worker(alive=True, groups=[stale] * 2, groups_started=2, groups_done=2)
    with pytest.raises(BatchTimeout) as e:
        collect_groups(worker, 1, 5, _args(drop_stale=True), [], {"stop": False})  # trainer at version 5
    assert "2 groups dropped as stale" in str(e.value)


def _group(admitted: int, lens_versions: list[tuple[int, int, int]], rewards=(0.0, 1.0)):
    """A group of one completion per (generated tokens, oldest version, newest version) turn list."""
    comps = []
    for n, lo, hi in lens_versions:
        c = RolloutCompletion(prompt_len=2, prompt_messages=[])
        c.add_turn(TurnRecord(tuple(range(n)), (-1.0,) * n, "stop", (lo, hi)))
        comps.append(c)
    return RolloutGroup(
        prompt_messages=[], prompt_ids=[1, 2], row={"_index": admitted}, completions=comps,
        rewards=list(rewards), advantages=[0.0] * len(comps), admitted_version=admitted,
        metrics=group_metrics(comps),
    )  # fmt: skip


def test_late_groups_are_trained_and_their_token_lags_counted_in_versions():
    """A long group admitted at version 0 arrives when the trainer is at version 3 (max staleness 1):
    kept by default, its tokens' lags (versions, the unit of admission and of --drop-stale) counted;
    dropped only with --drop-stale, and then the length ratio shows the bias."""
    late = _group(0, [(40, 0, 0), (40, 0, 1)])  # turn 2 spans a sync: lag from its oldest version
    fresh = _group(3, [(4, 3, 3), (4, 3, 3)])
    kept, taken, dropped, _, _ = collect_groups(
        _fake_worker(True, [late, fresh]), 2, 3, _args(), [], {"stop": False}
    )
    assert kept == [late, fresh] and dropped == 0
    m = rollout_metrics(kept, dropped, 0, taken, version=3)
    assert m["rollout/token_lag_max"] == 3 and m["rollout/token_lag_3"] == 80 / 88
    assert m["rollout/token_lag_0"] == 8 / 88 and m["rollout/token_lag_4plus"] == 0
    assert m["rollout/token_lag_mean"] == pytest.approx(240 / 88)
    assert m["rollout/trained_vs_admitted_len"] == 1.0 and m["rollout/staleness_max"] == 3

    worker = _fake_worker(True, [late, fresh, fresh])
    kept, taken, dropped, _, _ = collect_groups(worker, 2, 3, _args(drop_stale=True), [], {"stop": False})
    assert kept == [fresh, fresh] and dropped == 1
    m = rollout_metrics(kept, dropped, 0, taken, version=3)
    assert m["rollout/dropped_stale"] == 1 and m["rollout/token_lag_max"] == 0
    assert m["rollout/admitted_len_mean"] == (80 + 16) / 6
    assert m["rollout/trained_vs_admitted_len"] == pytest.approx(4 / 16)


def test_reward_and_accuracy_are_of_every_group_sampled_not_only_those_trained():
    """Two solved groups (equal rewards: skipped by the loss) and one half solved: 5 of 6 completions
    solved. Of the trained group alone the step said 0.5, so a policy that solved more read no better."""
    solved, half = (
        _group(0, [(4, 0, 0)] * 2, rewards=(1.0, 1.0)),
        _group(0, [(4, 0, 0)] * 2, rewards=(1.0, 0.0)),
    )
    kept, taken, dropped, skipped, _ = collect_groups(
        _fake_worker(True, [solved, solved, half]), 1, 0, _args(), [], {"stop": False}
    )
    assert kept == [half] and skipped == 2
    m = rollout_metrics(kept, dropped, skipped, taken, version=0)
    assert m["rollout/reward_mean"] == pytest.approx(5 / 6) and m["rollout/accuracy"] == pytest.approx(5 / 6)
    assert m["rollout/reward_min"] == 0.0 and m["rollout/skipped_equal_reward"] == 2


def test_a_resumed_run_appends_its_lines_after_a_cut_one(tmp_path):
    """A run killed mid-write leaves metrics.jsonl (or completions.jsonl) with a cut last line; the
    resumed run's first line was appended to it, and both were lost to every reader."""
    path = tmp_path / "metrics.jsonl"
    for before in ["", '{"step": 1}\n', '{"step": 1}\n{"step": 2, "rollout/rew']:
        path.write_text(before)
        with open_jsonl(path) as f:
            f.write(json.dumps({"step": 2}) + "\n")
        lines = path.read_text().splitlines()
        assert json.loads(lines[-1]) == {"step": 2} and path.read_text().startswith(before), lines
        assert len(lines) == before.count("\n") + (not before.endswith("\n") and before != "") + 1


def test_row_stream_resumes_where_it_left_off():
    rows = [{"question": str(i)} for i in range(5)]
    full = row_stream(rows, seed=3)
    first = [next(full) for _ in range(13)]
    assert sorted(r["question"] for r in first[:5]) == [str(i) for i in range(5)]  # an epoch is a permutation
    assert [r["_index"] for r in first] == list(range(13))
    resumed = row_stream(rows, seed=3, start=7)
    assert [next(resumed) for _ in range(6)] == first[7:13]


def test_lr_schedule():
    assert trainer.lr_lambda(0, 4, 10, "constant") == pytest.approx(0.2)
    assert trainer.lr_lambda(4, 4, 10, "constant") == 1.0
    assert trainer.lr_lambda(10, 0, 10, "cosine") == pytest.approx(0.0, abs=1e-9)
    assert trainer.lr_lambda(5, 0, 10, "cosine") == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------
# END TO END: the real script, its own vLLM server (weight sync mutates it), kill -9, resume
# ---------------------------------------------------------------------------------------------------
def _model() -> Path:
    warm = REPO / "models" / "tiny-warm"
    return warm if (warm / "config.json").exists() else REPO / "models" / "tiny"


def kill_launched_servers(out: Path) -> None:
    """After a kill -9 of the trainer writing `out`: its launched servers' API servers die with it
    (PR_SET_PDEATHSIG) but vLLM's engine processes may not, so their process groups go too."""
    for server in json.loads((out / "vllm-logs" / "servers.json").read_text()):
        try:
            os.killpg(server["pgid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cmd(out: Path, max_steps: int, *extra: str) -> list[str]:
    # Rewards of the tiny models are almost always all equal: --keep-zero-variance keeps the batches
    # coming, and weight decay makes every step change the weights (zero advantages give zero gradients),
    # so "the resumed weights equal the checkpoint's" cannot pass by the weights never moving.
    return [
        sys.executable, str(REPO / "train_async_grpo.py"), "--model", str(_model()), "--env", "retool",
        "--output-dir", str(out), "--max-steps", str(max_steps), "--prompts-per-step", "2",
        "--num-generations", "4", "--max-context", "512", "--max-turns", "2", "--save-every", "2",
        "--sync-every", "1", "--keep-zero-variance", "--lr", "1e-3", "--weight-decay", "0.1",
        "--log-completions-every", "1", "--eval-every", "2", "--eval-limit", "2", "--batch-timeout", "300",
        *extra,
    ]  # fmt: skip


def _checksum(ckpt: Path) -> float:
    return param_checksum(load_file(ckpt / "model.safetensors").items())


@pytest.mark.slow
def test_end_to_end_kill_and_resume(tmp_path, trainer_server):
    """The first run launches its own server (pinned to --rollout-cpus) and is killed (-9) after its
    step-2 checkpoint; the resumed run trains on the session's server (`--vllm-url`: it pushes its
    checkpoint's weights in at start, and a second launch would test nothing the first did not)."""
    out = tmp_path / "run"
    log1 = open(tmp_path / "run1.log", "w")
    rollout_cpu = max(os.sched_getaffinity(0))
    cmd = _cmd(out, 8, "--rollout-cpus", str(rollout_cpu), "--report-to", "trackio")
    # trackio is not installed here: a module of its name records what the tracker is given.
    (tmp_path / "trackio.py").write_text(
        "import json, os\ndef init(**kw): pass\ndef finish(): pass\n"
        "def log(metrics, step):\n    with open(os.environ['TRACKED'], 'a') as f:\n"
        "        f.write(json.dumps([step, sorted(metrics)]) + '\\n')\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TRACKED": str(tmp_path / "tracked.jsonl")}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log1, stderr=subprocess.STDOUT, env=env)
    ckpt2 = out / "checkpoints" / "step_000002"
    wait_for(ckpt2.exists, proc, tmp_path / "run1.log", 600, "step-2 checkpoint")
    # --rollout-cpus: the launched server, every process of it, is on the generation side's CPU.
    server_pids = group_pids(json.loads((out / "vllm-logs" / "servers.json").read_text())[0]["pgid"])
    assert server_pids and {os.sched_getaffinity(p) == {rollout_cpu} for p in server_pids} == {True}
    os.kill(proc.pid, signal.SIGKILL)  # kill -9 mid-run
    proc.wait()
    log1.close()
    kill_launched_servers(out)

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "eval/accuracy" in lines[0]  # the eval at start
    tracked = [json.loads(line) for line in (tmp_path / "tracked.jsonl").read_text().splitlines()]
    assert tracked[0][0] == 0 and "eval/accuracy" in tracked[0][1], (
        "the eval at start never reached the tracker"
    )
    assert [step for step, _ in tracked[1:3]] == [1, 2]
    lines = lines[1:]
    assert [m["step"] for m in lines[:2]] == [1, 2]
    assert lines[0]["sandbox/mode"] == isolation_mode() and "sandbox/mode" not in lines[1]  # once, at start
    required = [
        "rollout/reward_mean", "rollout/reward_std", "rollout/reward_min", "rollout/reward_max",
        "rollout/accuracy", "rollout/advantage_mean", "rollout/advantage_std", "train/loss",
        "train/clip_low_frac", "train/clip_high_frac", "train/is_ratio_mean", "train/is_ratio_max",
        "train/is_capped_frac", "train/mismatch_kl", "train/entropy", "train/grad_norm", "train/lr",
        "rollout/completion_len_mean", "rollout/completion_len_max", "rollout/stop_eos",
        "rollout/stop_max_turns", "rollout/stop_context_budget", "rollout/turns_per_completion",
        "rollout/tool_calls_per_completion", "rollout/tool_failure_rate", "rollout/staleness_mean",
        "rollout/staleness_max", "rollout/dropped_stale", "rollout/skipped_equal_reward", "perf/wait_s",
        "perf/idle_frac", "perf/gen_tok_s", "perf/train_tok_s", "sync/seconds", "model_version",
    ]  # fmt: skip
    for m in lines:
        assert not [k for k in required if k not in m], m
    assert lines[1]["model_version"] == 2 and lines[1]["sync/seconds"] > 0
    assert "eval/accuracy" in lines[1] and "eval/tool_call_rate" in lines[1]
    assert (out / "completions.jsonl").read_text().strip()

    # The checkpoint: complete (no temp dir left as the latest), loadable, and trained.
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "trainer_state.pt",
        "row_stream.json",
        "run_args.json",
    } <= {p.name for p in ckpt2.iterdir()}
    AutoModelForCausalLM.from_pretrained(ckpt2)
    state = torch.load(ckpt2 / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and state["model_version"] == 2 and state["dataset_position"] >= 4
    assert _checksum(ckpt2) != pytest.approx(_checksum(_model()), rel=1e-9)

    # Resume from that checkpoint (not from a later one the killed run may have written).
    for later in (out / "checkpoints").glob("step_*"):
        if later != ckpt2:
            subprocess.run(["rm", "-rf", str(later)], check=True)
    # `--resume` without the run's --lr and --weight-decay: a resume continues the checkpoint's.
    resume = " ".join(_cmd(out, 3, "--resume", "--vllm-url", trainer_server.url))
    resume = resume.replace(" --lr 1e-3 --weight-decay 0.1", "").split()
    r = subprocess.run(resume, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resuming with the checkpoint's --lr 0.001 --weight-decay 0.1" in r.stdout, r.stdout[-3000:]
    resumed = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("resumed from")]
    assert resumed and "at step 2, model version 2" in resumed[0], resumed
    checksum = float(resumed[0].rsplit("param checksum ", 1)[1].rstrip(")"))
    assert checksum == pytest.approx(_checksum(ckpt2), rel=1e-12)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["model_version"] == 3
    # No row trained before the checkpoint is generated again: each is at or after its frontier, or one
    # it had admitted and not trained (tests/test_resume.py checks every row over a kill).
    step3 = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    step3 = [x for x in step3 if x["step"] == 3][-2:]
    untrained = set(state["pending_rows"])
    assert step3 and all(
        x["row_index"] >= state["dataset_position"] or x["row_index"] in untrained for x in step3
    )
    assert (out / "checkpoints" / "step_000003" / "model.safetensors").exists()

    # Another seed, or another dataset, would map the checkpoint's stream indices to other rows: one line,
    # exit 2, before anything starts.
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join((REPO / "data" / "retool_train.jsonl").read_text().splitlines(True)[:50]))
    # So would another --lr (the optimizer state holds the checkpoint's), and a directory that is not a
    # checkpoint (the run's own output dir).
    for other, says in [
        (["--resume", "--seed", "1"], "would name other rows"),
        (["--resume", "--dataset", str(fewer)], "would name other rows"),
        (["--resume", "--lr", "1e-4"], "was trained with --lr 0.001 (this run: 0.0001); a resume continues"),
        (["--resume", str(out)], "is not a checkpoint (no trainer_state.pt)"),
    ]:
        r = subprocess.run(_cmd(out, 4, *other), cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr.splitlines()[-1], r.stderr[-2000:]
        assert not (out / "checkpoints" / "step_000004").exists()


DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)  # DAPO-Math-17k's user prompt


def _dapo_parquet(path: Path, n: int) -> list[dict]:
    """The first `n` retool rows in DAPO-Math-17k's layout (a chat-message prompt asking for an `Answer:`
    line, the gold answer in reward_model.ground_truth), written as parquet; returns the plain rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(x) for x in (REPO / "data" / "retool_train.jsonl").read_text().splitlines()[:n]]
    dapo = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(r["question"])}],
            "ability": "MATH",
            "reward_model": {"ground_truth": r["answer"], "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": str(k)},
        }
        for k, r in enumerate(rows)
    ]
    pq.write_table(pa.Table.from_pylist(dapo), path)
    return rows


# ---------------------------------------------------------------------------------------------------
# RANKS: FSDP2 over gloo gives the one-process gradient; the real script under torchrun
# ---------------------------------------------------------------------------------------------------
def _step_args(*flags: str) -> argparse.Namespace:
    """The real parser's defaults and `flags`; 24-token micro-batches (several per batch), T = 0.8, and
    no gradient clipping (it would hide a wrong gradient scale)."""
    args = T.parser.parse_args(
        ["--model", "m", "--micro-batch-tokens", "24", "--temperature", "0.8", "--max-grad-norm", "1e9"]
        + list(flags)
    )
    args.compute_dtype = args.compute_dtype or "fp32"
    return args


def _one_sgd_step(
    model_dir: Path, seqs: list[dict], rank: int, world_size: int, loss_norm: str, mini_batches: int = 1,
    lr: float = 0.5, compute_dtype: str = "fp32", flags: tuple[str, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> tuple:  # fmt: skip
    """One train_step with plain SGD (update = −lr · gradient, so the update shows the gradient's scale;
    AdamW's first step would not), on weights of `dtype` (float64: the step checked exactly, free of
    the CPU's float32 summation order). Returns (metrics, full weights, traced logprobs) on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if world_size > 1:
        shard_model(model, compute_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = _step_args(*flags)
    args.loss_norm, args.mini_batches, args.compute_dtype = loss_norm, mini_batches, compute_dtype
    cpu = torch.device("cpu")
    seen = []  # the dtype of the weights a layer computes with (FSDP2 swaps in the gathered ones)
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    traced = {}
    metrics = T.train_step(model, None, optimizer, scheduler, seqs, args, rank, world_size, cpu, traced)
    metrics["compute_weight_dtype"] = seen[0]
    if world_size == 1:
        return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}, traced
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return metrics, get_model_state_dict(model, options=opts), traced


def _fsdp_rank(rank: int, world_size: int, port: int, model_dir: Path, seqs: list[dict], out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # fmt: skip
    assert init_distributed(0, 120)[:2] == (rank, world_size)
    results = {  # float64: the ranks' step against one process's exactly (test_mini_batches_... says why)
        (norm, n): _one_sgd_step(model_dir, seqs, rank, world_size, norm, n, dtype=torch.float64)
        for norm in ("token", "sequence")
        for n in (1, 2)
    }
    results["bf16"] = _one_sgd_step(model_dir, seqs, rank, world_size, "token", compute_dtype="bf16")
    # Truncation, no sequence traced: rank 1's filler micro-batch has no position the head scores.
    untraced = [{k: v for k, v in s.items() if k != "trace"} for s in seqs]
    results["top-k"] = _one_sgd_step(
        model_dir, untraced, rank, world_size, "token", flags=TRUNCATION, dtype=torch.float64
    )
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # leave together (test_distributed's resume test says why)
    dist.destroy_process_group()
    os._exit(0)  # as test_distributed's resume ranks do


def _seqs_for_ranks() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    seqs = [_seq(p, c, gen) for p, c in [(5, 9), (3, 4), (7, 12), (4, 6), (6, 3)]]
    for k, s in enumerate(seqs):  # values float32 holds exactly: collate stores them in float32
        s["advantage"] = [1.0, -0.5, 0.75, -1.25, 0.25][k]
        s["behaviour"] = [-2.0 - 0.125 * j if m else 0.0 for j, m in enumerate(s["mask"])]
    return seqs


def _reference_steps(
    model_dir: Path, seqs: list[dict], n_mini: int, loss_norm: str, lr: float, top_k: int = 0,
    top_p: float = 1.0, dtype: torch.dtype = torch.float32,
) -> tuple:  # fmt: skip
    """The PPO update written out: π_old of every sequence from one no-grad forward (for N = 1 the same
    numbers as the forward's own, detached), then per 1/N of the sequences one SGD step on the loss of
    the formula in loss.py, each sequence forwarded alone (no packing), denominators of that 1/N.
    Logprobs are those of vLLM's own top-k/top-p code (the sampler the servers run) at T = 0.8.
    Returns (mean loss, [loss tokens, clip_low tokens, clip_high tokens], weights)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    def logprobs(s):
        ids = torch.tensor(s["ids"])[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1] / 0.8
        k = torch.full((len(logits),), top_k) if top_k else None
        p = torch.full((len(logits),), top_p) if top_p < 1 else None
        dropped = torch.isinf(apply_top_k_top_p_pytorch(logits.detach().clone(), k, p))  # it works in place
        # the trainer's one rule on top of vLLM's: the target stays in (the set grows down to its logit), so
        # a token that left the set after a mini-batch's update is not −inf (sampling.py)
        dropped &= logits.detach() < logits.detach().gather(1, ids[0, 1:, None])
        lp = torch.log_softmax(logits.masked_fill(dropped, float("-inf")), -1)
        return torch.cat([lp.new_zeros(1), lp.gather(1, ids[0, 1:, None])[:, 0]])

    with torch.no_grad():
        old = [logprobs(s) for s in seqs]
    losses, counts = [], [0, 0, 0]
    for j in range(n_mini):
        mini = range(j * len(seqs) // n_mini, (j + 1) * len(seqs) // n_mini)
        n_tok = sum(sum(seqs[i]["mask"]) for i in mini)
        n_seq = sum(1 for i in mini if sum(seqs[i]["mask"]))
        model.zero_grad()
        loss = 0.0
        for i in mini:
            s, lp = seqs[i], logprobs(seqs[i])
            mask, a = torch.tensor(s["mask"], dtype=dtype), s["advantage"]
            r = torch.exp(lp - old[i])
            w = torch.exp(old[i] - torch.tensor(s["behaviour"], dtype=dtype)).clamp(max=2.0)
            per_token = -w * torch.minimum(r * a, r.clamp(0.8, 1.28) * a) * mask
            loss = loss + (
                per_token.sum() / n_tok if loss_norm == "token" else per_token.sum() / mask.sum() / n_seq
            )
            counts[0] += int(mask.sum())
            counts[1] += int(((r < 0.8) & (mask > 0)).sum()) if a < 0 else 0
            counts[2] += int(((r > 1.28) & (mask > 0)).sum()) if a > 0 else 0
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(loss.item())
    return sum(losses) / n_mini, counts, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_weights_equal_in_float64(weights: dict, ref64: dict, what: str = "") -> None:
    """The trainer's float64 update against the hand-written float64 one: equal to float64 rounding
    (~1e-16, amplified by this test's large steps to well under 1e-10), so any defect in the step shows,
    and no CPU's float32 summation order can fail it (tests/test_train.py's old float32 comparison failed
    on AVX2 kernels: 9e-6 against a 1e-6 tolerance after three steps at lr 20)."""
    for k in ref64:
        torch.testing.assert_close(weights[k], ref64[k], rtol=1e-10, atol=1e-12, msg=f"{what} {k}")


@pytest.mark.parametrize("n_mini", [1, 2, 3])
@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_mini_batches_take_the_hand_written_ppo_steps(tiny_model, norm, n_mini):
    """Packed micro-batches (24 tokens: several per mini-batch), N optimizer steps per batch: the same
    loss, token counts, clip counts and weights as the update written out by hand. N = 1 is the one
    full-batch step the trainer always took."""
    seqs = _seqs_for_ranks()
    lr = 0.5 if n_mini == 1 else 20.0  # large steps, so later mini-batches are clipped (if n_mini > 1)
    metrics, weights, _ = _one_sgd_step(tiny_model, seqs, 0, 1, norm, n_mini, lr=lr)
    loss, (n_tok, clip_low, clip_high), ref_weights = _reference_steps(tiny_model, seqs, n_mini, norm, lr)
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["train/loss_tokens"] == n_tok == sum(sum(s["mask"]) for s in seqs)
    assert metrics["train/clip_low_frac"] == pytest.approx(clip_low / n_tok)
    assert metrics["train/clip_high_frac"] == pytest.approx(clip_high / n_tok)
    assert metrics["train/optimizer_steps"] == n_mini
    assert (clip_low > 0 and clip_high > 0) == (n_mini > 1)  # both clipped branches are exercised
    # The update itself, exactly: trainer and hand-written step both in float64.
    m64, w64, _ = _one_sgd_step(tiny_model, seqs, 0, 1, norm, n_mini, lr=lr, dtype=torch.float64)
    loss64, counts64, ref64 = _reference_steps(tiny_model, seqs, n_mini, norm, lr, dtype=torch.float64)
    assert counts64 == [n_tok, clip_low, clip_high]  # no clip decision sits within float32 noise
    assert m64["train/loss"] == pytest.approx(loss64, rel=1e-10)
    _assert_weights_equal_in_float64(w64, ref64)


def _greedy_seqs(model_dir: Path) -> list[dict]:
    """_seqs_for_ranks with each completion replaced by the model's greedy continuation of its prompt:
    tokens a truncated sampler can draw (a random token falls outside a top-k set)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seqs = _seqs_for_ranks()
    for s in seqs:
        n_prompt, n = s["mask"].index(1), len(s["ids"])
        ids = torch.tensor(s["ids"][:n_prompt])[None]
        with torch.no_grad():
            s["ids"] = model.generate(ids, max_new_tokens=n - n_prompt, min_new_tokens=n - n_prompt,
                                      do_sample=False)[0].tolist()  # fmt: skip
    return seqs


TRUNCATION = ("--top-k", "20", "--top-p", "0.9")


@pytest.mark.parametrize("n_mini", [1, 2])
def test_top_k_top_p_train_the_hand_written_step_with_vllms_truncation(tiny_model, n_mini):
    """--top-k 20 --top-p 0.9 from the real parser: the trainer's loss forward uses the truncated
    distribution (a trainer that ignored the flags, or any other truncation, fails here), and its loss
    is finite. With 2 mini-batches the first step pushes some of the second's tokens out of the kept
    set; they stay in it (finite), as the reference has it."""
    seqs = _greedy_seqs(tiny_model)
    flags, lr = TRUNCATION, 0.5
    metrics, weights, _ = _one_sgd_step(tiny_model, seqs, 0, 1, "token", n_mini, lr=lr, flags=flags)
    loss, (n_tok, _, _), ref_weights = _reference_steps(tiny_model, seqs, n_mini, "token", lr, 20, 0.9)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])
    assert metrics["train/loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["train/loss_tokens"] == n_tok
    _, w64, _ = _one_sgd_step(
        tiny_model, seqs, 0, 1, "token", n_mini, lr=lr, flags=flags, dtype=torch.float64
    )
    _, _, ref64 = _reference_steps(tiny_model, seqs, n_mini, "token", lr, 20, 0.9, dtype=torch.float64)
    _assert_weights_equal_in_float64(w64, ref64)
    untruncated, _, _ = _one_sgd_step(tiny_model, seqs, 0, 1, "token", n_mini, lr=lr)
    assert untruncated["train/loss"] != pytest.approx(loss, rel=1e-3)  # truncation changes this step


def test_the_clip_is_live_with_mini_batches(tiny_model):
    """A batch built to need clipping: the same two sequences twice, advantage +1 and −1. With two
    mini-batches the first step raises one and lowers the other, so the second mini-batch's ratios
    against π_old leave [0.8, 1.28] on both sides; with one step per batch the ratio is 1."""
    a, b = _seqs_for_ranks()[:2]
    a["advantage"], b["advantage"] = 1.0, -1.0
    seqs = [a, b, a, b]
    one, _, _ = _one_sgd_step(tiny_model, seqs, 0, 1, "token", 1, lr=100.0)
    two, _, _ = _one_sgd_step(tiny_model, seqs, 0, 1, "token", 2, lr=100.0)
    assert one["train/clip_low_frac"] == one["train/clip_high_frac"] == 0
    assert two["train/clip_low_frac"] > 0 and two["train/clip_high_frac"] > 0


def test_two_fsdp_ranks_take_the_one_process_step(tmp_path, tiny_model):
    """Five sequences in three micro-batches: rank 1 also runs a masked filler micro-batch. The summed
    loss, the gradient norm and the updated weights must equal one process's, with one and with two
    optimizer steps per batch (mini-batches of 2 and 3 sequences: ranks pad each one on its own), and
    with --top-k/--top-p on a step that traces nothing (the filler then has no position to score)."""
    import torch.multiprocessing as mp

    from vllm_server import free_port

    seqs = _seqs_for_ranks()
    for k in (0, 2, 4):
        seqs[k]["trace"] = k
    assert len(pack(seqs, _step_args().micro_batch_tokens)) == 3
    out = tmp_path / "rank0.pt"
    mp.spawn(_fsdp_rank, args=(2, free_port(), tiny_model, seqs, out), nprocs=2, join=True)
    two = torch.load(out, weights_only=False)
    for norm, n in [key for key in two if key not in ("bf16", "top-k")]:
        metrics, weights, traced = _one_sgd_step(tiny_model, seqs, 0, 1, norm, n, dtype=torch.float64)
        m2, w2, traced2 = two[norm, n]
        assert sorted(traced) == sorted(traced2) == [0, 2, 4]
        for k in traced:
            torch.testing.assert_close(
                torch.tensor(traced2[k]), torch.tensor(traced[k]), atol=1e-5, rtol=1e-5
            )
        for k in ["train/loss", "train/grad_norm", "train/loss_tokens", "train/entropy", "train/lr",
                  "train/clip_low_frac", "train/clip_high_frac", "train/is_ratio_mean"]:  # fmt: skip
            assert m2[k] == pytest.approx(metrics[k], rel=1e-5), (norm, n, k)
        assert metrics["train/grad_norm"] > 0
        assert w2.keys() == weights.keys()
        _assert_weights_equal_in_float64(w2, weights, f"two ranks against one, {norm} {n}")
    # --top-k/--top-p with nothing traced: the filler's empty head (no kept set) takes no gradient.
    untraced = [{k: v for k, v in s.items() if k != "trace"} for s in seqs]
    metrics, weights, _ = _one_sgd_step(
        tiny_model, untraced, 0, 1, "token", flags=TRUNCATION, dtype=torch.float64
    )
    m2, w2, _ = two["top-k"]
    assert m2["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-10)
    _assert_weights_equal_in_float64(w2, weights, "two ranks against one, --top-k --top-p")
    # The traced logprobs (the viewer's, from both ranks' micro-batches) are each sequence's own forward
    # before the update.
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        for k, lp in traced.items():
            ids = torch.tensor(seqs[k]["ids"])[None]
            alone, _ = token_logprobs(
                model, ids, torch.arange(ids.shape[1])[None], T.sampling_of(_step_args())
            )
            torch.testing.assert_close(torch.tensor(lp)[1:], alone[1:], atol=1e-5, rtol=1e-5)
    # bf16 compute: FSDP2's MixedPrecisionPolicy (bf16 gathers, fp32 reduce, fp32 shards) against one
    # process's autocast. The two round in different places (the policy also casts the norms' weights),
    # so the updates agree to bf16 precision, not bit for bit (the relative error is printed).
    start = load_file(tiny_model / "model.safetensors")
    metrics, weights, _ = _one_sgd_step(tiny_model, seqs, 0, 1, "token", compute_dtype="bf16")
    m2, w2, _ = two["bf16"]
    assert m2["train/loss"] == pytest.approx(metrics["train/loss"], rel=1e-2)
    assert m2["compute_weight_dtype"] == torch.bfloat16  # the policy gathers bf16 weights ...
    assert all(w.dtype == torch.float32 for w in w2.values())  # ... from fp32 masters
    update = torch.cat([(weights[k] - start[k]).flatten() for k in weights])
    update2 = torch.cat([(w2[k] - start[k]).flatten() for k in weights])
    print(f"bf16 FSDP2 vs one process: update relative error {(update2 - update).norm() / update.norm():.2e}")
    assert (update2 - update).norm() <= 0.02 * update.norm()


def _adamw_step_changed_fraction(model, compute_dtype: str, seqs: list[dict]) -> float:
    """One AdamW step at the default lr 1e-6; the share of weights with a gradient that moved."""
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    out_dtypes = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: out_dtypes.add(out.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    args = _step_args()
    args.compute_dtype, args.max_grad_norm = compute_dtype, 1.0
    T.train_step(model, None, optimizer, scheduler, seqs, args, 0, 1, torch.device("cpu"))
    assert out_dtypes == {torch.bfloat16}  # the matmuls ran in bf16
    assert all(s.dtype == p.dtype for p in model.parameters() for s in optimizer.state[p].values() if s.ndim)
    moved = touched = 0
    for k, p in model.named_parameters():
        has_grad = p.grad != 0  # rows of tokens absent from the batch have none
        moved += int(((p.detach() != before[k]) & has_grad).sum())
        touched += int(has_grad.sum())
    return moved / touched


def test_bf16_compute_over_fp32_weights_moves_nearly_every_weight(tiny_model):
    """At lr 1e-6 an AdamW update is far below half a bf16 ulp: bf16 weights barely move (measured 2 %
    moved), fp32 masters under bf16 autocast all do; the weights and AdamW's state stay fp32."""
    gen = torch.Generator().manual_seed(1)
    seqs = [_seq(p, c, gen) for p, c in [(5, 9), (3, 4), (7, 12), (4, 6), (6, 3)]]
    for k, s in enumerate(seqs):
        s["advantage"] = [1.0, -0.5, 0.7, -1.2, 0.3][k]
        s["behaviour"] = [-6.0 if m else 0.0 for m in s["mask"]]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert _adamw_step_changed_fraction(model, "bf16", seqs) > 0.99
    assert all(p.dtype == torch.float32 for p in model.parameters())
    bf16_weights = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    assert _adamw_step_changed_fraction(bf16_weights, "bf16", seqs) < 0.1


def test_bf16_compute_logprobs_match_fp32(tiny_model):
    """The logprobs of bf16 autocast (log-softmax still in fp32) against fp32: within 0.02 nats on
    every token (measured 0.006 max, 0.0016 mean on the tiny model)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    mb = collate([_seq(5, 9, gen), _seq(3, 4, gen), _seq(7, 12, gen)], "cpu")
    with torch.no_grad():
        fp32, _ = token_logprobs(model, mb["input_ids"], mb["position_ids"], Sampling(0.8))
        bf16, _ = token_logprobs(model, mb["input_ids"], mb["position_ids"], Sampling(0.8), bf16=True)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)  # bf16 matmuls did run
    torch.testing.assert_close(bf16, fp32, atol=0.02, rtol=0)


@pytest.mark.slow
def test_two_ranks_under_torchrun(tmp_path):
    """The real script on 2 CPU ranks (FSDP2 over gloo) with its own server, on a DAPO-format parquet
    dataset: it finishes, logs every step, syncs every step, stops its server, and checkpoints weights
    that both ranks trained. FSDP2 gives rank r the r-th half of each parameter's rows and no rank holds
    a whole copy, so "the ranks agree" means: each half moved (weight decay moves every weight each
    step) and the gathered checkpoint is a loadable model."""
    out, dapo = tmp_path / "run", tmp_path / "dapo.parquet"
    rows = _dapo_parquet(dapo, 16)  # and DAPO-Math-17k's layout, from parquet
    cmd = _cmd(out, 3, "--micro-batch-tokens", "256", "--dataset", str(dapo))
    cmd[1:2] = ["-m", "torch.distributed.run", "--nproc-per-node", "2", cmd[1]]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and steps[-1]["model_version"] == 3
    assert all(m["sync/seconds"] > 0 for m in steps)
    for server in json.loads((out / "vllm-logs" / "servers.json").read_text()):
        assert group_pids(server["pgid"]) == []
    ckpt = out / "checkpoints" / "step_000003"
    AutoModelForCausalLM.from_pretrained(ckpt)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3 and "model.embed_tokens.weight" in state["optimizer"]["state"]
    start, trained = load_file(_model() / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert start.keys() == trained.keys()
    logged = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert logged and all("The last line of your response" in json.dumps(x) for x in logged)  # DAPO's rows
    ep = load_env("retool").make_episode(load_rows(str(dapo))[0])  # the `Answer:` line it asks for
    assert ep.reward([{"role": "assistant", "content": f"So\nAnswer: {rows[0]['answer']}"}], []) == 1.0
    for k, w in trained.items():
        half = w.shape[0] // 2
        assert not torch.equal(w[:half], start[k][:half]) and not torch.equal(w[half:], start[k][half:]), k


# ---------------------------------------------------------------------------------------------------
# DEVICES: the plan for 0, 1, 2 and 8 GPUs, checked before anything starts
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_gpus, ranks, vllm_gpus, tp, servers, rank_devices",
    [
        (0, 1, None, 1, ["cpu"], ["cpu"]),  # CPU: one server, whatever --vllm-gpus says
        (0, 2, 3, 1, ["cpu"], ["cpu", "cpu"]),
        (2, 1, None, 1, ["0"], ["cuda:1"]),  # the README's one-process command on 2 GPUs
        (2, 1, 1, 1, ["0"], ["cuda:1"]),
        (8, 6, None, 1, ["0", "1"], [f"cuda:{g}" for g in range(2, 8)]),  # the README's 8-GPU command
        (8, 6, 2, 1, ["0", "1"], [f"cuda:{g}" for g in range(2, 8)]),
        (8, 1, None, 1, [str(g) for g in range(7)], ["cuda:7"]),
        (8, 4, None, 2, ["0,1", "2,3"], ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]),
        (8, 2, 4, 2, ["0,1", "2,3"], ["cuda:4", "cuda:5"]),  # GPUs 6, 7 left idle, as asked
    ],
)
def test_device_plan_fits(num_gpus, ranks, vllm_gpus, tp, servers, rank_devices):
    assert plan_devices(num_gpus, ranks, vllm_gpus, tp, launch_servers=True) == (servers, rank_devices)


@pytest.mark.parametrize(
    "num_gpus, ranks, vllm_gpus, tp, says",
    [
        (1, 1, None, 1, "1 GPU visible: a launched vLLM server and the trainer cannot share it"),
        (1, 1, 1, 1, "pass --vllm-url"),
        (
            2,
            1,
            2,
            1,
            "2 server GPU(s) + 1 trainer rank(s) > 2 GPUs visible; try --vllm-gpus 1 with --nproc-per-node 1",
        ),
        (2, 2, None, 1, "2 trainer rank(s) leave 0 of 2 GPUs for vLLM servers"),
        (8, 6, 4, 1, "try --vllm-gpus 2 with --nproc-per-node 6 or --vllm-gpus 4 with --nproc-per-node 4"),
        (8, 8, None, 1, "try --vllm-gpus 1 --vllm-tp 1 with --nproc-per-node 7"),
        (
            8,
            4,
            3,
            2,
            "--vllm-gpus 3 is not a multiple of --vllm-tp 2; try --vllm-gpus 4 with --nproc-per-node 4",
        ),
    ],
)
def test_device_plan_that_does_not_fit_says_what_would(num_gpus, ranks, vllm_gpus, tp, says):
    with pytest.raises(ValueError) as e:
        plan_devices(num_gpus, ranks, vllm_gpus, tp, launch_servers=True)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_device_plan_with_servers_given_by_url():
    assert plan_devices(1, 1, None, 1, launch_servers=False) == ([], ["cuda:0"])
    assert plan_devices(8, 8, None, 1, launch_servers=False) == ([], [f"cuda:{g}" for g in range(8)])
    with pytest.raises(ValueError, match="use --nproc-per-node ≤ 2"):
        plan_devices(2, 4, None, 1, launch_servers=False)
    line = describe_plan(8, ["0", "1"], ["cuda:2", "cuda:3"])
    assert line == (
        "device plan (8 GPU(s) visible): vLLM servers on GPU 0 | 1; trainer rank 0 → cuda:2, rank 1 → cuda:3"
    )


def test_a_layout_that_does_not_fit_fails_before_anything_starts(monkeypatch, capsys, tmp_path, tiny_model):
    """main() on a mocked one-GPU box: one line, exit 2, no server, no model, no CUDA call."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as e:
        T.main(["--model", str(tiny_model), "--output-dir", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "1 GPU visible" in err and "--vllm-url" in err
