"""Environments: what the model talks to and what it is rewarded for.

An environment is a module with `SYSTEM_PROMPT` and `make_episode(row) -> Episode`; an Episode has
`messages` (system + user), `tools` (async functions; schema via `transformers.utils.get_json_schema`),
`answer`, `reward(messages, tool_calls) -> float` and optionally `is_done() -> bool`.
"""

import functools
import importlib
import inspect
import sys
from types import ModuleType

# --env NAME -> module. `math` lives in math_env.py so running a file from envs/ cannot shadow stdlib math.
ENVS = {"retool": "envs.retool", "math": "envs.math_env"}


def load_env(name: str) -> ModuleType:
    """The environment module for `--env NAME`; ValueError listing the choices for an unknown name."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; available: {', '.join(sorted(ENVS))}")
    return importlib.import_module(ENVS[name])


def episode_maker(name: str, sandbox_workers: int, unsafe_sandbox: bool, rank: int = 0):
    """(make_episode, the sandbox/ line of the first step's metrics). An env whose episodes run tools
    gets a sandbox; a sandbox that cannot confine them here stops the run (one line)
    unless `unsafe_sandbox` (--unsafe-sandbox)."""
    env = load_env(name)
    if not _runs_tools(env):
        return env.make_episode, {}
    from envs.confine import landlock_description
    from envs.sandbox import forks_refused, isolation_gaps, isolation_mode

    if rank == 0:  # Landlock is what confines the files in mode seccomp: say what of it applies
        landlock = f"; {landlock_description()}" if isolation_mode() == "seccomp" else ""
        if forks_refused():
            landlock += "; the code may start no process or thread (uid 0 and no pids cgroup to bound them)"
        print(f"sandbox isolation: {isolation_mode()}{landlock}", flush=True)
    if isolation_gaps() and not unsafe_sandbox:
        sys.exit(
            f"sandbox isolation {isolation_mode()!r} cannot stop {', '.join(isolation_gaps())} here "
            "(it needs root with CAP_SYS_ADMIN, user namespaces, or seccomp with Landlock); "
            "pass --unsafe-sandbox to accept the risk"
        )
    return episodes_of(env, sandbox_workers), {"sandbox/mode": isolation_mode()}


def episodes_of(env: ModuleType, sandbox_workers: int):
    """`env.make_episode`, given a Sandbox of its own when its episodes run tools (the rollout process
    builds its own this way, after the trainer's `episode_maker` checked the isolation)."""
    if not _runs_tools(env):
        return env.make_episode
    from envs.sandbox import Sandbox

    return functools.partial(env.make_episode, sandbox=Sandbox(sandbox_workers))


def _runs_tools(env: ModuleType) -> bool:
    return "sandbox" in inspect.signature(env.make_episode).parameters
