"""Fault injection on the real pipeline (models/tiny-warm, which calls the tool): the cases the module
tests do not cover. `make faults` runs this file alone. Each case and its outcome is in README.md's
"Fault tolerance" table. The session's server (`trainer_server`, tests/conftest.py) serves every case in
file order; one case kills it and restarts it on the same port."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import wait_for
from test_weight_sync import max_diff, weight_version  # what weight sync is tested with
from transformers import AutoModelForCausalLM, AutoTokenizer

from batches import BatchTimeout, collect_groups
from chat_format import ChatTemplate
from checkpoint import latest_checkpoint
from envs import load_env
from envs.data import load_rows
from rollout import AsyncRolloutWorker, VLLMClient
from vllm_server import group_pids, healthy

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tiny-warm"
START_TIMEOUT = float(os.environ.get("VLLM_START_TIMEOUT", 600))


def trainer_cmd(out: Path, max_steps: int, *extra: str) -> list[str]:
    # --keep-zero-variance: the tiny model's rewards are mostly all equal; without it batches rarely come.
    return [
        sys.executable, str(REPO / "train_async_grpo.py"), "--model", str(MODEL), "--env", "retool",
        "--output-dir", str(out), "--max-steps", str(max_steps), "--prompts-per-step", "2",
        "--num-generations", "4", "--max-context", "512", "--max-turns", "2", "--save-every", "1000",
        "--keep-zero-variance", "--lr", "1e-3", "--log-completions-every", "1", "--sandbox-workers", "2",
        "--batch-timeout", "300", *extra,
    ]  # fmt: skip


def steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines()] if path.exists() else []


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, grandchildren, ...), from /proc's ppid fields."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def alive(pids: set[int]) -> set[int]:
    live = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    live.add(p)
        except OSError:
            pass
    return live


# ---------------------------------------------------------------------------------------------------
# CASE 3 (sandbox part): a sandbox run dies with the process that started it, even by SIGKILL
# ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_sandbox_dies_with_a_killed_parent():
    code = "import time; time.sleep(300)"  # sleeping burns no CPU: RLIMIT_CPU would never fire
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import asyncio; from envs.sandbox import run_python; "
         f"asyncio.run(run_python({code!r}, timeout_s=300))"],
        cwd=REPO,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(descendants(parent.pid)) < 3:  # unshare → namespace init shell → python
        assert time.monotonic() < deadline and parent.poll() is None, "the sandbox did not start"
        time.sleep(0.1)
    time.sleep(0.5)
    tree = descendants(parent.pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(tree), f"sandbox processes outlived their killed parent: {alive(tree)}"


# ---------------------------------------------------------------------------------------------------
# CASE 6: a bad dataset row fails before anything starts
# ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_bad_dataset_row_fails_before_anything_starts(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    out = tmp_path / "run"
    r = subprocess.run(
        trainer_cmd(out, 1, "--dataset", str(data)), cwd=REPO, capture_output=True, text=True, timeout=170
    )
    assert r.returncode != 0
    assert "row 1: no answer" in r.stderr, r.stderr[-2000:]
    assert not (out / "vllm-logs").exists()  # no server was launched


# ---------------------------------------------------------------------------------------------------
# CASES 5 and 6 on the worker: a trainer that stops reading; a reward function that raises
# ---------------------------------------------------------------------------------------------------
def _worker(server, make_episode, **kw) -> AsyncRolloutWorker:
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    env = load_env("retool")
    rows = iter(load_rows(str(REPO / "data" / "retool_train.jsonl")) * 10)
    template = ChatTemplate(tokenizer, tools=env.make_episode(next(rows)).tools)
    client = VLLMClient([server.url], str(MODEL), request_timeout_s=120)
    return AsyncRolloutWorker(
        client, template, make_episode or env.make_episode, rows, num_generations=4, max_turns=2,
        max_context=512, **kw,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_queue_full_for_a_long_time_stays_bounded(trainer_server):
    worker = _worker(trainer_server, None, groups_per_version=2, max_staleness=1)
    bound = worker.queue.maxsize  # 2 groups per version × (1 + max_staleness)
    worker.start()
    try:
        deadline = time.monotonic() + 240
        while worker.queue.qsize() < bound:  # the trainer reads nothing
            assert time.monotonic() < deadline and worker.alive, worker.stats
            time.sleep(0.2)
        t_full = time.monotonic()
        while time.monotonic() - t_full < 4:  # full for 20 report periods: nothing more is started
            assert worker.queue.qsize() <= bound and worker.stats.groups_started <= bound
            time.sleep(0.2)
        assert worker.stats.groups_started == bound and worker.alive
        # The trainer comes back: everything queued is there, and new versions admit new groups.
        got = [worker.queue.get(timeout=1) for _ in range(bound)]
        worker.set_version(1)
        got.append(worker.queue.get(timeout=120))
        assert worker.stats.groups_started == bound + 2
        for g in got:
            for c in g.completions:
                assert len(c.completion_ids) == len(c.behaviour_logprobs) == len(c.loss_mask)
    finally:
        t0 = time.monotonic()
        worker.stop(timeout_s=5)
        assert time.monotonic() - t0 < 6 and not worker.alive


@pytest.mark.timeout(300)
def test_reward_that_raises_drops_groups_and_names_the_cause(trainer_server):
    env = load_env("retool")

    def make_episode(row):
        ep = env.make_episode(row)

        def reward(messages, tool_calls):
            raise ZeroDivisionError("reward boom")

        ep.reward = reward
        return ep

    worker = _worker(trainer_server, make_episode, groups_per_version=2, group_retries=1)
    worker.start()
    try:
        deadline = time.monotonic() + 240
        while worker.stats.groups_failed < 2:
            assert time.monotonic() < deadline and worker.alive, worker.stats
            time.sleep(0.2)
        args = SimpleNamespace(batch_timeout=1.0, max_staleness=1, keep_zero_variance=True)
        with pytest.raises(BatchTimeout) as e:
            collect_groups(worker, 2, 0, args, [trainer_server.url], {"stop": False})
    finally:
        worker.stop(timeout_s=5)
    assert worker.stats.groups_retried >= 2 and worker.stats.groups_done == 0
    assert "most groups failed" in str(e.value) and "ZeroDivisionError: reward boom" in str(e.value)


# ---------------------------------------------------------------------------------------------------
# CASE 4: Ctrl-C at any point: everything stops in < 10 s with a final checkpoint
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("delay_s", [0.0, 1.5])
def test_sigint_stops_fast_with_a_checkpoint(trainer_server, tmp_path, delay_s):
    out, log = tmp_path / "run", tmp_path / "run.log"
    url = trainer_server.url
    with open(log, "w") as f:
        proc = subprocess.Popen(trainer_cmd(out, 50, "--vllm-url", url), cwd=REPO, stdout=f, stderr=f)
    try:
        wait_for(lambda: len(steps_logged(out)) >= 1, proc, log, 300, "step 1")
        time.sleep(delay_s)  # 0: right after a step, in generation; 1.5 s later: anywhere in the loop
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        shutdown_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    print(f"SIGINT after {delay_s} s: exit {rc} in {shutdown_s:.1f} s")
    assert shutdown_s < 10, text[-3000:]
    assert rc == 0 and "interrupted at step" in text, text[-3000:]
    step = max(steps_logged(out))
    assert (out / "checkpoints" / f"step_{step:06d}" / "trainer_state.pt").exists(), text[-3000:]
    assert healthy(url)  # a server we did not start is left running


# The trainer with its optimizer update slowed down: after the 2nd update a marker file appears and the
# step sleeps before train_step returns, so a signal sent then lands inside the optimizer update. Each
# update appends the weights' checksum (parameters in optimizer order) to a file.
SLOW_OPTIMIZER = """
import json, sys, time, torch
sys.path.insert(0, {repo!r})
import train_async_grpo as T
step, updates = torch.optim.AdamW.step, []
def slow_step(self, *args, **kwargs):
    out = step(self, *args, **kwargs)
    params = [p for g in self.param_groups for p in g["params"]]
    updates.append(sum(float(p.detach().double().abs().sum()) * (k + 1) for k, p in enumerate(params)))
    open({checksums!r}, "w").write(json.dumps(updates))
    if len(updates) == 2:
        open({marker!r}, "w").close()
        time.sleep(3)
    return out
torch.optim.AdamW.step = slow_step
T.main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigint_inside_the_optimizer_update_leaves_a_consistent_checkpoint(trainer_server, tmp_path):
    """Ctrl-C is deferred in one process too: the step finishes, the run stops before the next one, and
    the checkpoint's step, weights and AdamW state all belong to the same step."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    marker, checksums = tmp_path / "in-update", tmp_path / "checksums.json"
    code = SLOW_OPTIMIZER.format(repo=str(REPO), marker=str(marker), checksums=str(checksums))
    cmd = trainer_cmd(out, 50, "--vllm-url", trainer_server.url)
    cmd[1:2] = ["-c", code]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=f)
    try:
        wait_for(marker.exists, proc, log, 400, "the 2nd optimizer update")
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0 and "interrupted at step" in text, text[-3000:]
    ckpt = latest_checkpoint(out)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    step = state["step"]
    assert ckpt.name == f"step_{step:06d}"
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {step}  # AdamW's own count
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    saved = sum(float(p.detach().double().abs().sum()) * (k + 1) for k, p in enumerate(model.parameters()))
    assert saved == pytest.approx(json.loads(checksums.read_text())[step - 1], rel=1e-12)
    assert step == 2  # the interrupted step was finished, not dropped


def wait_until_quiet(server, proc: subprocess.Popen, log: Path, quiet_s: float = 5.0) -> None:
    """Until no completion request has reached `server` for `quiet_s` (bounded: 300 s)."""
    start, seen, t_last = server.log_size(), -1, time.monotonic()
    deadline = t_last + 300
    while time.monotonic() - t_last < quiet_s:
        assert time.monotonic() < deadline, "requests never stopped: " + log.read_text()[-3000:]
        assert proc.poll() is None, log.read_text()[-3000:]
        count = server.log_since(start).count("POST /v1/completions")
        if count != seen:
            seen, t_last = count, time.monotonic()
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------------
# CASES 1 and 2: the server is killed mid-rollout, the next weight sync meets it dead, it is restarted
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_server_killed_mid_rollout_and_restarted_the_run_goes_on(trainer_server, tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    server, steps = trainer_server, 5
    with open(log, "w") as f:
        proc = subprocess.Popen(
            trainer_cmd(out, steps, "--vllm-url", server.url), cwd=REPO, stdout=f, stderr=f
        )
    try:
        wait_for(lambda: len(steps_logged(out)) >= 2, proc, log, 300, "step 2")
        # The server dies while the trainer holds its next batch, so that the next sync meets it dead
        # (case 2): the trainer is stopped while the rollout process (not stopped) finishes what
        # --max-staleness 1 admits (the next two batches); the server is killed once no request has
        # come for 5 s. Killed with the queue empty, no batch would come and no sync would meet it.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            wait_until_quiet(server, proc, log)
            os.killpg(server.proc.pid, signal.SIGKILL)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        t_kill = time.monotonic()
        wait_for(lambda: "failed on 1 server" in log.read_text(), proc, log, 120, "the failed sync")
        server_log_start = server.log_size()
        server.restart()  # what a supervisor would do: same port, base weights, no transfer group
        server.wait_healthy(START_TIMEOUT)
        outage_s = time.monotonic() - t_kill
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    print(f"outage {outage_s:.0f} s; exit {rc}")
    print(
        "\n".join(ln for ln in text.splitlines() if "vLLM server" in ln or "weight" in ln or "counters" in ln)
    )
    assert rc == 0 and steps_logged(out) == list(range(1, steps + 1)), text[-4000:]
    sync_error = next(ln for ln in text.splitlines() if "failed on 1 server" in ln)
    assert server.url in sync_error and "pause" in sync_error, sync_error  # named, with its phase
    assert f"{server.url}: new weight-transfer group" in text, text[-4000:]
    counters = next(ln for ln in text.splitlines() if ln.startswith("rollout counters"))
    taken_out, back = re.search(r"servers taken out (\d+), back (\d+)", counters).groups()
    assert int(taken_out) >= 1 and int(back) >= 1, counters
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(m["sync/servers_failed"] == 1 for m in metrics) and metrics[-1]["sync/servers_failed"] == 0
    # No token of the run came from the restarted server before it held the trainer's weights: in its
    # log, the first completion it served comes after the re-sync set its version.
    restarted = server.log_since(server_log_start)
    first_completion = restarted.index("POST /v1/completions")
    assert restarted.index("POST /finish_weight_update") < first_completion, restarted[-3000:]
    # And what it holds now is the trainer's final model: same version tag, same logprobs.
    assert weight_version(server.url) == str(metrics[-1]["model_version"])
    final = AutoModelForCausalLM.from_pretrained(
        out / "checkpoints" / f"step_{steps:06d}", dtype=torch.float32
    )
    assert max_diff(final, server.url) < 1e-3


# ---------------------------------------------------------------------------------------------------
# CASES 1 and 3: the trainer relaunches its own server when it dies; kill -9 of the trainer leaves no
# server or sandbox process behind
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_own_server_relaunched_and_sigkill_of_the_trainer_leaves_no_orphans(tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            trainer_cmd(out, 100, "--server-timeout", str(START_TIMEOUT)), cwd=REPO, stdout=f, stderr=f
        )
    servers_file = out / "vllm-logs" / "servers.json"
    try:
        wait_for(lambda: len(steps_logged(out)) >= 1, proc, log, 800, "step 1")
        # First its own server dies: the trainer relaunches it (same port), re-syncs it and goes on.
        first_pgid = json.loads(servers_file.read_text())[0]["pgid"]
        os.killpg(first_pgid, signal.SIGKILL)
        wait_for(
            lambda: "new weight-transfer group" in log.read_text(), proc, log, START_TIMEOUT, "the relaunch"
        )
        steps_after_relaunch = len(steps_logged(out)) + 1
        wait_for(lambda: len(steps_logged(out)) >= steps_after_relaunch, proc, log, 300, "a step after it")
        assert json.loads(servers_file.read_text())[0]["pgid"] != first_pgid and not group_pids(first_pgid)
        tree = descendants(proc.pid)  # the server's group, its watchdog, any live sandbox run
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "exited with code -9; relaunching it" in text, text[-3000:]
    pgids = [s["pgid"] for s in json.loads(servers_file.read_text())]
    deadline = time.monotonic() + 15
    while (alive(tree) or any(group_pids(g) for g in pgids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(tree) | {p for g in pgids for p in group_pids(g)}
    for p in left:  # don't leave them to the next test either
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes outlived the killed trainer: {left}"
    assert len(tree) >= 2  # it did start a server (and its watchdog)


@pytest.mark.parametrize(
    "exc, saved, released",
    [
        (None, True, True),  # max_steps reached
        (KeyboardInterrupt(), True, True),
        (BatchTimeout("no batch"), True, True),
        ("NonFiniteWeights", False, True),  # every rank raised it after the step: released, not saved
        (RuntimeError("mid-step"), False, False),  # maybe inside a collective: neither
    ],
)
def test_shutdown_acts_on_the_exception_main_passes(monkeypatch, tmp_path, exc, saved, released):
    """main() hands shutdown the exception that ended the run; in its `finally`, sys.exc_info() is None
    for every exception an `except` clause handled. The other FSDP ranks are released (a stop message)
    whenever they wait for one, and the weights saved only when they are whole and finite."""
    import train_async_grpo as T

    if exc == "NonFiniteWeights":
        exc = T.NonFiniteWeights("model.norm.weight is non-finite after the AdamW step")
    events = []
    monkeypatch.setattr(T, "save", lambda run: events.append("saved") or tmp_path)
    monkeypatch.setattr(T, "broadcast_message", lambda msg, world: events.append(msg))
    monkeypatch.setattr(T.dist, "destroy_process_group", lambda: None)
    run = T.Run(
        SimpleNamespace(), tmp_path, None, None, None, None, world_size=2, step=3, version=3, position=None,
        stop_flag={}, last_saved=2, metrics_file=open(tmp_path / "m", "w"),
        completions_file=open(tmp_path / "c", "w"),
    )  # fmt: skip
    T.shutdown(run, exc)
    assert ("saved" in events) == saved and ({"stop": True} in events) == released, events


# ---------------------------------------------------------------------------------------------------
# A server the trainer launches that never answers: one line with its log's tail, exit 1, nothing left
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a warm model and a vLLM server (for a second)
@pytest.mark.timeout(300)
def test_a_server_that_never_becomes_ready_ends_the_run_in_one_line(tmp_path):
    """--server-timeout 1: no vLLM answers that fast. The run said so in a traceback from inside
    vllm_server (TimeoutError); now in the refusal's line, exit 1, with no server process left."""
    out = tmp_path / "run"
    r = subprocess.run(
        trainer_cmd(out, 1, "--server-timeout", "1"), cwd=REPO, capture_output=True, text=True, timeout=280
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    line = re.search(
        r"^vLLM server http://[\d.]+:(\d+) not healthy after 1 s; log \S+ ends with:$", r.stderr, re.M
    )
    assert line, r.stderr[-3000:]
    # Every process of that server (API, engine, watchdog) has its run dir in its environment or argv.
    run_dir = f"vllm-run-{line[1]}-".encode()
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            seen = Path(f"/proc/{pid}/environ").read_bytes() + Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if run_dir in seen and alive({int(pid)}):
            left.append(pid)
    assert not left, f"server processes left: {left}"
