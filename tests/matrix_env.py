"""The flag matrix's shaped-reward environment and its launcher (tests/test_flag_matrix.py).

`retool_shaped` is `--env retool` with a shaped reward in the spirit of the one envs/retool.py suggests
trying: a wrong answer scores −0.9 plus 0.1 per successful tool call (so −0.9, −0.8, …: rewards that are
not binary fractions, and every group of wrong answers, which is most groups of the tiny models, is a
group of equal non-dyadic rewards whose advantages must be exactly zero). Not an `envs/` environment:
the matrix runs the trainer through `python tests/matrix_env.py <trainer args>` (also under torchrun),
which registers it and calls train_async_grpo.main.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from envs import ENVS, retool  # noqa: E402

SYSTEM_PROMPT = retool.SYSTEM_PROMPT


def make_episode(row: dict, sandbox=None) -> retool.Episode:
    return retool.make_episode(row, sandbox=sandbox, wrong_reward=-0.9, tool_bonus=0.1)


if __name__ == "__main__":
    ENVS["retool_shaped"] = "tests.matrix_env"  # before the trainer builds its --env choices
    import train_async_grpo

    train_async_grpo.main(sys.argv[1:])
