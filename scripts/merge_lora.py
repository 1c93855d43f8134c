"""Fold a LoRA adapter into its base model and write a full model for serving without LoRA (any
engine, no `--enable-lora`: vLLM decodes ~1.3× slower with an unmerged adapter).

python scripts/merge_lora.py --adapter runs/latest/adapters/v12 --out runs/latest/merged

The adapter is a PEFT directory (adapter_config.json + adapter_model.safetensors: what lora.write_adapter
writes for the servers). The base is the adapter's `base_model_name_or_path` unless --base says
otherwise. The merge is done in fp32 (W + α/r · B A) and written in --dtype; the tokenizer and chat
template are copied from the base, so the output directory serves as it is.
tests/test_lora.py checks the merged model's logprobs against the server's unmerged adapter.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lora import merge  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--adapter", required=True, help="a PEFT adapter directory")
parser.add_argument("--out", required=True, help="where to write the merged model")
parser.add_argument("--base", default=None, help="the base model (default: the adapter's own)")
parser.add_argument(
    "--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the written weights"
)


def main() -> None:
    args = parser.parse_args()
    config = Path(args.adapter) / "adapter_config.json"
    if not config.is_file():
        sys.exit(f"--adapter {args.adapter}: no adapter_config.json there (give a version's directory, "
                 "<output-dir>/adapters/v<N>, or a LoRA checkpoint's)")  # fmt: skip
    base = args.base or json.loads(config.read_text())["base_model_name_or_path"]
    try:
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args.adapter
        )
    except (OSError, RuntimeError) as e:  # no such model; or an adapter of other shapes (size mismatch)
        why = " ".join(str(e).split())[:300]
        sys.exit(f"base model {base} cannot be loaded with adapter {args.adapter} ({why}): pass --base with "
                 "the model the adapter was trained on")  # fmt: skip
    merged = merge(model).to(getattr(torch, args.dtype))
    merged.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(base).save_pretrained(args.out)
    print(f"merged {args.adapter} into {base}: {args.out}")


if __name__ == "__main__":
    main()
