"""tools/export_hf.py: a checkpoint of trained (here: perturbed) FSDP2 weights becomes a Hugging Face
directory that transformers and the vLLM CPU engine load, scoring like the trainer."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import EngineThread
from distributed import run_ranks

from molt.distributed.parallelize import ShardingPlan, TrainerMesh
from molt.trainer.actor import Actor
from molt.trainer.scoring import compute_token_logprobs
from molt.trainer.sharded_model import build_actor_model
from molt.trainer.checkpoint import save_checkpoint
from molt.trainer.optimizer import OptimizerSettings

# gloo ranks and a vLLM engine: not in the unit tier
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROBE = list(range(3, 45))
TOOL = Path(__file__).resolve().parents[1] / "tools" / "export_hf.py"


def _train_and_save(rank, world_size, model_dir, root):
    group = dist.group.WORLD
    model = build_actor_model(model_dir, mesh=TrainerMesh.from_group(group, "cpu"), device=torch.device("cpu"),
                              plan=ShardingPlan())
    actor = Actor(model, group=group, device=torch.device("cpu"), optimizer=OptimizerSettings(lr=1e-3))
    generator = torch.Generator().manual_seed(rank + 1)
    with torch.no_grad():  # each rank moves its own shard: the whole model changes
        for param in model.parameters():
            local = param.to_local()
            local.add_(torch.randn(local.shape, generator=generator) * 0.02)
        ids = torch.tensor([PROBE])
        logprobs = compute_token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0].tolist()
    model.reshard()
    save_checkpoint(root, 5, trainables={"actor": actor}, group=group, rank=rank,
                    state={"step": 5, "model_path": str(model_dir)} if rank == 0 else None, keep_last=1)
    return logprobs


def _load_tool():
    spec = importlib.util.spec_from_file_location("export_hf", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_exported_checkpoint_loads_in_transformers_and_vllm_and_scores_like_the_trainer(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trainer_logprobs = run_ranks(_train_and_save, 2, str(tiny_model_dir), str(tmp_path / "ckpt"))[0]
    out = _load_tool().export_hf(tmp_path / "ckpt" / "step_00000005", tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]

    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        exported = compute_token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0].tolist()
        original = compute_token_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ids,
                                          torch.ones_like(ids), temperature=1.0)[0].tolist()
    assert max(abs(a - b) for a, b in zip(exported, trainer_logprobs)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(original, trainer_logprobs)) > 1e-2  # the weights did change

    engine = EngineThread(out)
    try:
        engine_logprobs = engine.run(engine.engine.score(PROBE))
    finally:
        engine.close()
    assert max(abs(a - b) for a, b in zip(engine_logprobs[1:], trainer_logprobs[1:])) <= 1e-4


def test_an_exported_vision_language_checkpoint_keeps_its_processor_and_scores_like_the_trainer(
        tmp_path, tiny_vlm_path):
    """A VLM checkpoint exports as image-text-to-text with its whole processor (image settings and chat
    template), which `python -m molt.eval --checkpoint step_N` and vLLM need."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    trainer_logprobs = run_ranks(_train_and_save, 2, str(tiny_vlm_path), str(tmp_path / "ckpt"))[0]
    out = _load_tool().export_hf(tmp_path / "ckpt" / "step_00000005", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Idefics3ForConditionalGeneration"]
    processor = AutoProcessor.from_pretrained(out)
    assert processor.image_processor.size == AutoProcessor.from_pretrained(tiny_vlm_path).image_processor.size
    assert processor.chat_template

    model = AutoModelForImageTextToText.from_pretrained(out)
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        exported = compute_token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0].tolist()
    assert max(abs(a - b) for a, b in zip(exported, trainer_logprobs)) <= 1e-5
