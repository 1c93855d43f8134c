"""Environments: what the model talks to and what it is rewarded for.

An environment is a module with `SYSTEM_PROMPT` and `make_episode(row) -> Episode`; an Episode has
`messages` (system + user), `tools` (async functions; schema via `transformers.utils.get_json_schema`),
`answer`, `reward(messages, tool_calls) -> float` and optionally `is_done() -> bool`.
"""

import importlib
from types import ModuleType

# --env NAME -> module. `math` lives in math_env.py so running a file from envs/ cannot shadow stdlib math.
ENVS = {"retool": "envs.retool", "math": "envs.math_env"}


def load_env(name: str) -> ModuleType:
    """The environment module for `--env NAME`; ValueError listing the choices for an unknown name."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; available: {', '.join(sorted(ENVS))}")
    return importlib.import_module(ENVS[name])
