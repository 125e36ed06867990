"""Turn a Molt checkpoint into a standard Hugging Face model directory (safetensors) that
`transformers` and vLLM load: the actor's trained weights, the base model's config, tokenizer (a
vision-language model's whole processor) and generation config.

    python tools/export_hf.py CHECKPOINT OUT_DIR [--base MODEL_DIR]

CHECKPOINT is a complete `step_<N>` directory (molt/trainer/checkpoint.py); MODEL_DIR (default: the run's
model.path, recorded in the checkpoint) supplies the architecture, tokenizer and dtype. Runs in one
process without a process group: torch.distributed.checkpoint reads every rank's shards.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from anywhere without installing molt

from molt.trainer.checkpoint import COMPLETE  # noqa: E402


def export_hf(checkpoint: str | Path, out_dir: str | Path, base: str | None = None) -> Path:
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    from molt.models.vision_language import auto_model_class, is_vision_language

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / COMPLETE).is_file():
        raise SystemExit(f"{checkpoint} is not a complete Molt checkpoint (no {COMPLETE} marker)")
    base = base or json.loads((checkpoint / "state.json").read_text()).get("model_path")
    if not base:
        raise SystemExit(f"{checkpoint} does not record its model.path; pass --base MODEL_DIR")
    config = AutoConfig.from_pretrained(base)
    model = auto_model_class(config).from_pretrained(base)
    saved = FileSystemReader(str(checkpoint / "model")).read_metadata().state_dict_metadata
    # Tied weights appear once in the checkpoint; the model's other name for them shares the tensor.
    wanted = {name: tensor for name, tensor in model.state_dict().items() if f"actor.model.{name}" in saved}
    missing = [name for name, _ in model.named_parameters() if name not in wanted]
    if missing:
        raise SystemExit(f"{checkpoint} lacks weights of {base}'s architecture, e.g. {missing[:3]}; "
                         f"is --base the model the run trained?")
    dcp.load({"actor": {"model": wanted}}, checkpoint_id=str(checkpoint / "model"), no_dist=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # A vision-language model's processor (image settings, chat template) goes with it, as vLLM needs it.
    (AutoProcessor if is_vision_language(config) else AutoTokenizer).from_pretrained(base).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a complete step_<N> checkpoint directory")
    parser.add_argument("out_dir", help="directory to write the Hugging Face model into")
    parser.add_argument("--base", default=None, help="base model directory (default: the run's model.path)")
    args = parser.parse_args()
    print(export_hf(args.checkpoint, args.out_dir, args.base))


if __name__ == "__main__":
    main()
