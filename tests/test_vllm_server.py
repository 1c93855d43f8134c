"""The foundation every token-accounting test stands on: the real engine, the tiny model and its tokenizer
agree, and the launcher leaves nothing behind."""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_server
from vllm_server import group_pids, start_vllm_server


def post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_token_ids_and_logprobs_match_transformers(vllm_server, served_model):
    tokenizer = AutoTokenizer.from_pretrained(served_model)
    messages = [{"role": "user", "content": "What is 4821 * 937?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    out = post(
        f"{vllm_server.url}/v1/completions",
        {
            "model": str(served_model),
            "prompt": prompt_ids,
            "max_tokens": 48,
            "temperature": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            "seed": 1,
        },
    )
    choice = out["choices"][0]
    completion_ids = choice["token_ids"]
    behaviour_logprobs = choice["logprobs"]["token_logprobs"]
    assert len(completion_ids) == len(behaviour_logprobs) == 48
    assert choice["prompt_token_ids"] == prompt_ids

    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    trainer_logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]
    torch.testing.assert_close(trainer_logprobs, torch.tensor(behaviour_logprobs), atol=1e-3, rtol=0)


def test_failed_start_reports_log_tail(tmp_path):
    """A model directory with no config: the server dies early and the error must carry its log. Nothing
    of it is left behind: its watchdog, lifeline and run dir lived on (until the caller exited) when the
    server exited during start-up, though a start-up timeout cleaned them up."""
    launched = []

    class Recorded(vllm_server.VLLMServer):  # the real launcher, remembered for the checks below
        def _launch(self) -> None:
            super()._launch()
            launched.append(self)

    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(RuntimeError, match="log .* ends with"):
        start_vllm_server(
            str(tmp_path / "not-a-model"), log_dir=tmp_path, timeout_s=120, server_class=Recorded
        )
    [server] = launched
    assert server not in vllm_server._live_servers
    assert server._watchdog.poll() is not None, "the watchdog outlived the failed start"
    assert not server.run_dir.exists() and group_pids(server.proc.pid) == []


@pytest.mark.timeout(300)
def test_server_dies_with_a_killed_parent(tiny_model, tmp_path):
    """SIGKILL the process that started a server: the whole server process group must go with it, and
    the directory of its sockets and rendezvous file (vLLM leaves them behind: in /tmp, four a start).
    On the way: a server given `cpus` runs every one of its processes there."""
    cpu = max(os.sched_getaffinity(0))
    child = textwrap.dedent(
        f"""
        import os, sys, time
        from vllm_server import group_pids, start_vllm_server
        s = start_vllm_server({str(tiny_model)!r}, log_dir={str(tmp_path)!r}, cpus="{cpu}")
        print(s.proc.pid, s.run_dir, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        pid, run_dir = proc.stdout.readline().split()
        server_pgid, run_dir = int(pid), Path(run_dir)
        modes = [p.stat().st_mode for p in run_dir.iterdir()]
        assert sum(map(stat.S_ISSOCK, modes)) >= 2 and any(
            p.name.startswith("vllm_dist_") for p in run_dir.iterdir()
        )
        pids = group_pids(server_pgid)
        assert len(pids) >= 2, "the API server and its engine core (which runs the model) should be running"
        assert {p: os.sched_getaffinity(p) for p in pids} == {p: {cpu} for p in pids}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while group_pids(server_pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_pids(server_pgid) == [], "vLLM processes outlived the killed parent"
        deadline = time.monotonic() + 10  # the watchdog removes it once the group is killed
        while run_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not run_dir.exists(), f"{run_dir} outlived the killed parent"
    finally:
        proc.kill()


@pytest.mark.parametrize("n", [0, -1])
def test_no_servers_asked_for_is_one_line(n, monkeypatch, capsys):
    """`--num-servers 0` started nothing and then waited forever on all() of no servers."""
    monkeypatch.setattr(sys, "argv", ["vllm_server.py", "--num-servers", str(n)])
    with pytest.raises(SystemExit) as e:
        vllm_server.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"--num-servers must be at least 1, got {n}")


def _mocked_gpu_box(monkeypatch, events: list, alive: bool) -> None:
    """A GPU box of 3 visible GPUs for `vllm_server.main()`: launches are recorded, not run; each wait
    takes 1,000 s of a clock of its own; once the servers are up, main() sees them `alive` (else exited
    with -9) and, alive, gets Ctrl-C."""
    clock = [0.0]

    def wait(s, timeout_s: float) -> None:
        events.append(("wait", s.url, timeout_s))
        clock[0] += 1000

    def ctrl_c(_s: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    server = vllm_server.VLLMServer
    monkeypatch.setattr(
        server,
        "_launch",
        lambda s: (
            setattr(s, "proc", SimpleNamespace(returncode=None if alive else -9)),
            events.append(("launch", s.url, s.env["CUDA_VISIBLE_DEVICES"])),
        ),
    )
    monkeypatch.setattr(server, "wait_healthy", wait)
    monkeypatch.setattr(server, "alive", lambda s: alive)
    monkeypatch.setattr(server, "stop", lambda s, grace_s=10.0: shutil.rmtree(s.run_dir))
    monkeypatch.setattr(vllm_server, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=ctrl_c))
    monkeypatch.setattr(vllm_server.signal, "signal", lambda *a: None)  # leave pytest's handlers alone


def test_num_servers_start_together_each_on_its_own_gpu(monkeypatch):
    """`vllm_server.py --num-servers 3`: every server is launched before any is waited on (N cold
    starts take the time of one), the waits share --start-timeout (it is the whole wait, not one per
    server), and server i gets GPU i of this process's CUDA_VISIBLE_DEVICES."""
    events = []
    _mocked_gpu_box(monkeypatch, events, alive=True)
    argv = ["vllm_server.py", "--num-servers", "3", "--port", "9100", "--start-timeout", "2400"]
    monkeypatch.setattr(sys, "argv", argv)
    vllm_server.main()
    urls = [f"http://127.0.0.1:{9100 + i}" for i in range(3)]
    assert events == [("launch", u, g) for u, g in zip(urls, ["2", "3", "5"])] + [
        ("wait", u, t) for u, t in zip(urls, [2400.0, 1400.0, 400.0])
    ]


def test_a_server_that_exits_while_serving_fails_the_command(monkeypatch, capsys):
    """A server killed while serving (an OOM kill, an engine crash) ends `vllm_server.py` with exit 1
    and one line naming it, not "a server exited; stopping" and exit 0 (Slurm and restart loops read
    a clean finish); more servers than visible GPUs is one line before anything starts."""
    _mocked_gpu_box(monkeypatch, [], alive=False)
    monkeypatch.setattr(sys, "argv", ["vllm_server.py", "--num-servers", "2", "--port", "9100"])
    with pytest.raises(SystemExit) as e:
        vllm_server.main()
    assert str(e.value.code).startswith(
        "vllm_server.py: vLLM server http://127.0.0.1:9100 exited with code -9"
    )
    monkeypatch.setattr(sys, "argv", ["vllm_server.py", "--num-servers", "4"])
    with pytest.raises(SystemExit) as e:
        vllm_server.main()
    assert e.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("--num-servers 4: one server a GPU, and 3 are visible")
    )


def test_a_port_already_in_use_is_one_line_not_someone_elses_health(tmp_path):
    """Another service on the port answered our health check: the command said it was serving, our
    vLLM died of "Address already in use", and it exited 0. Now the launch refuses the port at once."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is already in use"):
            vllm_server.start_vllm_server("models/tiny", port=port, log_dir=tmp_path, timeout_s=1)


def test_a_foreign_server_that_takes_our_port_during_start_up_is_refused(tiny_model, tmp_path):
    """The launch checks the port, then vLLM binds it ~10 s later (its import): another process that
    bound it in between answered /health with 200, and wait_healthy took it for our server (the run then
    talked to someone else's model; our vLLM died of "Address already in use"). Now the wait accepts only
    a listening socket of our own process group, and names the port, the other process and the way out."""
    port = vllm_server.free_port()
    server = start_vllm_server(str(tiny_model), port=port, log_dir=tmp_path, wait=False)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "health").write_text("ok")  # GET /health: 200
    foreign = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path / "foreign",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not vllm_server.healthy(server.url):  # the foreign one: ours is still importing vLLM
            assert foreign.poll() is None and server.alive()
            time.sleep(0.05)
        with pytest.raises(vllm_server.ServerStartError) as e:
            server.wait_healthy(60)
        message = str(e.value)
        assert "\n" not in message and f"port {port}" in message and f"pid {foreign.pid}" in message
        assert "choose another port or stop that process" in message
        assert group_pids(server.proc.pid) == [], "our server outlived its refused start"
        assert foreign.poll() is None, "the other process is not ours to stop"
    finally:
        server.stop()
        foreign.kill()
        foreign.wait()


def test_ports_handed_out_before_they_are_bound_are_distinct():
    """Servers started together (start_vllm_servers) and the transfer groups of a join each take a port
    before anything binds it: the kernel handed a just-released port out again (5 repeats in 400 calls
    here), so 8 servers shared a port in about 1 launch in 500 and one died of "Address already in use"."""
    ports = [vllm_server.free_port() for _ in range(600)]
    assert len(set(ports)) == len(ports), f"{len(ports) - len(set(ports))} ports handed out twice"


def test_a_restarted_server_keeps_its_run_dir(tmp_path):
    """heal's relaunch: the old watchdog, woken by stop(), removed the run dir (the server's sockets and
    TMPDIR) after restart() had made it again for the new server, which then died at start-up (real
    vLLM: 2 restarts in 10). stop() now returns once its watchdog is done."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stand_in = [sys.executable, "-c", "import time; time.sleep(600)"]
    s = vllm_server.VLLMServer(stand_in, {"PATH": os.environ["PATH"]}, "http://x", tmp_path / "log", run_dir)
    try:
        for _ in range(5):
            old_watchdog = s._watchdog
            s.restart()
            assert old_watchdog.poll() is not None
            time.sleep(0.2)
            assert run_dir.is_dir() and s.alive()
    finally:
        s.stop()
    assert not run_dir.exists() and s._watchdog.poll() is not None


def test_a_server_slower_than_the_start_timeout_fails_in_one_line(tiny_model):
    """A real server given 1 s: the command exits 1 naming the server, the limit and its log, with no
    traceback of ours."""
    port = vllm_server.free_port()
    cmd = [
        sys.executable,
        "vllm_server.py",
        "--model",
        str(tiny_model),
        "--port",
        str(port),
        "--start-timeout",
        "1",
    ]
    r = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=100
    )
    assert r.returncode == 1, r.stderr[-2000:]
    first = r.stderr.splitlines()[0]
    assert first.startswith(
        f"vllm_server.py: vLLM server http://127.0.0.1:{port} not healthy after 1 s; log "
    ), first
    assert not r.stderr.startswith("Traceback")


def test_relaunch_restarts_exited_and_stuck_servers(tmp_path):
    """heal's relaunch: a launched server that exited, and one the weight syncer names as stuck in an
    NCCL receive (alive, answering /health), are both restarted; the others are left alone."""
    restarted = []

    def server(url: str, alive: bool) -> SimpleNamespace:
        proc = SimpleNamespace(returncode=None if alive else -9, pid=1)
        restart = lambda: restarted.append(url)  # noqa: E731
        backoff = {"relaunched_at": None, "exited_at": None, "quick_exits": 0}
        return SimpleNamespace(url=url, alive=lambda: alive, proc=proc, restart=restart, **backoff)

    servers = [server("http://a", True), server("http://b", False), server("http://c", True)]
    vllm_server.relaunch_exited(servers, tmp_path / "servers.json", stuck={"http://c"})
    assert restarted == ["http://b", "http://c"]


def test_a_server_that_cannot_start_is_relaunched_at_doubling_waits(tmp_path, monkeypatch):
    """A launched server that exits at every start (its port taken by another process, its GPU full):
    heal relaunched it at every call, every 5 s while the trainer waited, for the rest of the run (each a
    vLLM start-up beside the training and a line on stderr). Now after 10 s, then at doubling waits up to
    300 s; and at once again when it exits after serving longer than that."""
    now = [0.0]

    class Clock:  # relaunch_exited's clock, 5 s a heal: the count may not depend on the machine's load
        monotonic = staticmethod(lambda: now[0])

        def __getattr__(self, name):
            return getattr(time, name)

    monkeypatch.setattr(vllm_server, "time", Clock())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    s = vllm_server.VLLMServer(["false"], {"PATH": os.environ["PATH"]}, "http://x", tmp_path / "log", run_dir)
    launched_at = []
    try:
        for _ in range(120):  # 10 minutes of heals
            proc = s.proc
            proc.wait()  # exited at start-up, as it does within 5 s
            vllm_server.relaunch_exited([s], tmp_path / "servers.json")
            if s.proc is not proc:
                launched_at.append(now[0])
            now[0] += 5
        assert launched_at == [0, 15, 40, 85, 170, 335]
        s.cmd = [sys.executable, "-c", "import time; time.sleep(600)"]  # it starts, and serves 6 minutes
        now[0] = 645
        vllm_server.relaunch_exited([s], tmp_path / "servers.json")
        now[0] += 360
        s.proc.kill()
        s.proc.wait()
        proc = s.proc
        vllm_server.relaunch_exited([s], tmp_path / "servers.json")
        assert s.proc is not proc and s.alive()
    finally:
        s.stop()


def test_the_servers_file_is_never_seen_half_written(tmp_path):
    """A reader (the person cleaning up after a kill -9, at any moment) finds a whole servers file while
    heal rewrites it: written in place, a read between the truncation and the write found it empty."""
    path = tmp_path / "servers.json"
    servers = [
        SimpleNamespace(url=f"http://127.0.0.1:{8000 + i}", proc=SimpleNamespace(pid=1000 + i))
        for i in range(64)
    ]
    vllm_server.write_servers_file(servers, path)
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import json, sys
                bad = 0
                for _ in range(20000):
                    try:
                        json.loads(open({str(path)!r}).read())
                    except ValueError:
                        bad += 1
                print(bad)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    while reader.poll() is None:
        vllm_server.write_servers_file(servers, path)
    assert reader.stdout.read().strip() == "0"
    assert json.loads(path.read_text())[63] == {"url": "http://127.0.0.1:8063", "pgid": 1063}
