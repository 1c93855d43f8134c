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
    if "sandbox" not in inspect.signature(env.make_episode).parameters:
        return env.make_episode, {}
    from envs.sandbox import Sandbox, isolation_gaps, isolation_mode

    if rank == 0:
        print(f"sandbox isolation: {isolation_mode()}", flush=True)
    if isolation_gaps() and not unsafe_sandbox:
        sys.exit(
            f"sandbox isolation {isolation_mode()!r} cannot stop {', '.join(isolation_gaps())} here "
            "(it needs root with CAP_SYS_ADMIN, user namespaces, or seccomp with Landlock); "
            "pass --unsafe-sandbox to accept the risk"
        )
    make_episode = functools.partial(env.make_episode, sandbox=Sandbox(sandbox_workers))
    return make_episode, {"sandbox/mode": isolation_mode()}
