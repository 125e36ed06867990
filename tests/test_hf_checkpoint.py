"""Sharded loading (molt.models.hf_checkpoint) against `from_pretrained`, on 2 gloo ranks."""

import gc
import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from distributed import run_ranks
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from molt.distributed.parallelize import TrainerMesh, build_trainer_mesh, shard_causal_lm
from molt.models.hf_checkpoint import (LoadReport, build_empty_model, load_sharded_weights, local_index,
                                       parameters_on_meta)
from molt.trainer.critic import ValueModel

CPU = torch.device("cpu")
TINY_VOCAB = 67  # odd, so the embedding's rows split unevenly (34/33) over two ranks


def save_qwen3(path: Path, *, tied: bool, max_shard_size: str | None = None, dtype=torch.float32,
               **sizes) -> Path:
    """A random Qwen3 (norm weights perturbed too, so no parameter keeps its init value)."""
    config = transformers.Qwen3Config(**{
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "intermediate_size": 96, "vocab_size": TINY_VOCAB, "max_position_embeddings": 128,
        "tie_word_embeddings": tied, "initializer_range": 0.1, **sizes})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def token_rows(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (3, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # one right-padded row
    return input_ids, attention_mask


def dp_mesh(world_size: int) -> TrainerMesh:
    return TrainerMesh.from_group(dist.new_group(list(range(world_size))), "cpu")


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: all ranks call it)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def causal_lm_rank(rank, world_size, model_path, tensor_parallel_size=1):
    model = build_empty_model(model_path, dtype=torch.float32)
    mesh = dp_mesh(world_size) if tensor_parallel_size == 1 else build_trainer_mesh(
        num_trainer_ranks=world_size, device_type="cpu", tensor_parallel_size=tensor_parallel_size)
    shard_causal_lm(model, mesh=mesh)
    report = load_sharded_weights(model, model_path, device=CPU)
    input_ids, attention_mask = token_rows(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"report": report, "weights": full_weights(model), "logits": logits, "tied": tied,
            "buffers": {name: b.clone() for name, b in model.named_buffers()}}


@pytest.mark.parametrize("tied, max_shard_size, file_dtype", [
    (True, "40KB", torch.float32),
    (False, "40KB", torch.float32),
    (False, None, torch.bfloat16),  # one file, cast up to the float32 parameters at load
], ids=["tied-several-files", "untied-several-files", "untied-one-bf16-file"])
def test_sharded_load_matches_from_pretrained(tmp_path, tied, max_shard_size, file_dtype):
    path = save_qwen3(tmp_path, tied=tied, max_shard_size=max_shard_size, dtype=file_dtype)
    num_files = len(list(tmp_path.glob("*.safetensors")))
    assert num_files > 1 if max_shard_size else num_files == 1
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    input_ids, attention_mask = token_rows(TINY_VOCAB)
    with torch.no_grad():
        expected_logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits

    results = run_ranks(causal_lm_rank, 2, str(path))

    expected_weights = dict(reference.named_parameters())
    for result in results:
        assert result["tied"] == tied
        assert result["report"].missing == [] and result["report"].unexpected == 0
        assert result["weights"].keys() == expected_weights.keys()
        for name, weight in result["weights"].items():
            assert torch.equal(weight, expected_weights[name]), name
        for name, buffer in reference.named_buffers():  # the rotary inv_freq, not in the file
            assert torch.equal(result["buffers"][name], buffer), name
        torch.testing.assert_close(result["logits"], expected_logits, rtol=0, atol=1e-5)
    # Between them the ranks read every tensor of the checkpoint exactly once.
    assert sum(result["report"].bytes_read for result in results) == checkpoint_bytes(path)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tensor_parallel_load_matches_from_pretrained(tmp_path, tied):
    """Tensor parallelism over 2 ranks: column-wise weights split on dim 0, row-wise on dim 1, the
    odd vocabulary unevenly; each rank reads its slices and both read the replicated norms."""
    path = save_qwen3(tmp_path, tied=tied, max_shard_size="40KB", num_key_value_heads=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    input_ids, attention_mask = token_rows(TINY_VOCAB)
    with torch.no_grad():
        expected_logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits

    results = run_ranks(causal_lm_rank, 2, str(path), 2)

    for result in results:
        assert result["tied"] == tied and result["report"].missing == []
        for name, weight in reference.named_parameters():
            assert torch.equal(result["weights"][name], weight), name
        torch.testing.assert_close(result["logits"], expected_logits, rtol=0, atol=1e-5)
    norm_bytes = sum(p.nbytes for name, p in reference.named_parameters() if name.endswith("norm.weight"))
    assert sum(result["report"].bytes_read for result in results) == checkpoint_bytes(path) + norm_bytes


def checkpoint_bytes(path: Path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as checkpoint:
            total += sum(checkpoint.get_tensor(key).nbytes for key in checkpoint.keys())
    return total


def test_fused_experts_load_from_per_expert_keys(tmp_path):
    """Qwen3-MoE checkpoints store each expert's gate/up/down projections under its own keys;
    transformers' model holds them fused as [experts, ...] tensors, which FSDP2 shards by expert
    (5 experts: 3 on rank 0, 2 on rank 1)."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2,
        vocab_size=TINY_VOCAB, max_position_embeddings=128, initializer_range=0.1)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path, max_shard_size="20KB")
    assert "model.layers.0.mlp.experts.4.up_proj.weight" in checkpoint_shapes(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    input_ids, attention_mask = token_rows(TINY_VOCAB)
    with torch.no_grad():
        expected_logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits

    results = run_ranks(causal_lm_rank, 2, str(tmp_path))

    assert sum(result["report"].bytes_read for result in results) == checkpoint_bytes(tmp_path)
    for result in results:
        assert result["report"].missing == [] and result["report"].unexpected == 0
        for name, weight in reference.named_parameters():
            assert torch.equal(result["weights"][name], weight), name
        torch.testing.assert_close(result["logits"], expected_logits, rtol=0, atol=1e-5)


def test_empty_model_has_meta_parameters_and_real_buffers(tmp_path):
    """Single process, no sharding: plain parameters are read whole."""
    path = save_qwen3(tmp_path, tied=True)
    model = build_empty_model(str(path), dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.use_cache is False
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    reference_buffers = dict(reference.named_buffers())
    assert reference_buffers.keys() == dict(model.named_buffers()).keys() != set()
    for name, buffer in model.named_buffers():
        assert not buffer.is_meta and torch.equal(buffer, reference_buffers[name]), name

    report = load_sharded_weights(model, str(path), device=CPU)

    assert report.missing == [] and report.unexpected == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, weight in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), weight), name


def measure_peak_rss_growth(run):
    """Run `run()`; return its result and the growth of peak resident memory (bytes) it caused.

    Resets the kernel's high-water mark (VmHWM) by writing 5 to /proc/self/clear_refs, so the
    peak is exact; where that is not permitted, samples VmRSS every millisecond instead (may
    miss a spike shorter than that). Both count file pages that safetensors has mapped, so the
    figure is an upper bound on the private memory the rank used.
    """
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        sampler = None
    except OSError:
        sampler = RssSampler()
        sampler.start()
    baseline = read_status_bytes("VmRSS")
    result = run()
    if sampler is None:
        return result, read_status_bytes("VmHWM") - baseline
    sampler.stop()
    return result, sampler.peak - baseline


def read_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class RssSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = read_status_bytes("VmRSS"), True

    def run(self):
        while self.running:
            self.peak = max(self.peak, read_status_bytes("VmRSS"))
            time.sleep(0.001)

    def stop(self):
        self.running = False
        self.join()
        self.peak = max(self.peak, read_status_bytes("VmRSS"))


def memory_rank(rank, world_size, model_path):
    mesh = dp_mesh(world_size)
    build_empty_model(model_path, dtype=torch.float32)  # imports and lazy set-up, not the model's memory

    def build_shard_load() -> LoadReport:
        model = build_empty_model(model_path, dtype=torch.float32)
        shard_causal_lm(model, mesh=mesh)
        return load_sharded_weights(model, model_path, device=CPU)

    report, peak_growth = measure_peak_rss_growth(build_shard_load)
    return {"bytes_read": report.bytes_read, "peak_growth": peak_growth}


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16-file", "fp32-file"])
def medium_model_path(request, tmp_path_factory) -> Path:
    """A Qwen3 of 68M parameters (32000 x 1024 tied embedding, 4 blocks) in ~50 MB files."""
    return save_qwen3(tmp_path_factory.mktemp("medium-qwen3"), tied=True, max_shard_size="50MB",
                      dtype=request.param, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32000)


def test_rank_reads_and_holds_only_its_shards(medium_model_path):
    """The point of sharded loading: no rank reads or holds the whole model on the host.

    Measured against the float32 model (274 MB), which is what the ranks hold. The bf16 file is
    the usual case (bf16 checkpoint, float32 parameters) and the telling one: `from_pretrained`
    then `fully_shard` peaks at ~1.5x the float32 model on every rank (the whole model cast to
    float32, plus the mapped file), this loader at ~0.6x (its half, plus the pages of the file
    being read). With a float32 file `from_pretrained` maps the file without copying and
    `fully_shard` copies only each rank's chunk, so it peaks at ~0.8x against ~0.6x here.
    """
    index = json.loads((medium_model_path / "model.safetensors.index.json").read_text())
    file_bytes = index["metadata"]["total_size"]
    model_bytes = 4 * sum(math.prod(shape) for shape in checkpoint_shapes(medium_model_path).values())
    assert model_bytes > 250e6

    results = run_ranks(memory_rank, 2, str(medium_model_path))

    assert sum(result["bytes_read"] for result in results) == file_bytes
    assert results[1]["bytes_read"] < 0.6 * file_bytes
    assert results[1]["peak_growth"] < 0.75 * model_bytes, (results[1]["peak_growth"], model_bytes)


def checkpoint_shapes(path: Path) -> dict[str, list[int]]:
    shapes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as checkpoint:
            shapes.update({key: checkpoint.get_slice(key).get_shape() for key in checkpoint.keys()})
    return shapes


def value_model_rank(rank, world_size, model_path, head_weight):
    backbone = build_empty_model(model_path, dtype=torch.float32, auto_class=transformers.AutoModel)
    model = ValueModel(backbone)
    mesh = dp_mesh(world_size).fsdp_mesh
    for block in backbone.layers:  # the critic's FSDP units
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = load_sharded_weights(model, model_path, device=CPU)
    with torch.no_grad():  # what the caller does with the missing head, with non-zero values here
        model.value_head.weight.to_local().copy_(head_weight[local_index(model.value_head.weight)])
        model.value_head.bias.to_local().fill_(0.5)
        values = model(*token_rows(backbone.config.vocab_size))
    return {"report": report, "values": values, "weights": full_weights(model)}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_backbone_loads_into_value_model(tmp_path, tied):
    path = save_qwen3(tmp_path, tied=tied, max_shard_size="40KB")
    head_weight = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    reference = ValueModel(transformers.AutoModel.from_pretrained(path, dtype=torch.float32))
    with torch.no_grad():
        reference.value_head.weight.copy_(head_weight)
        reference.value_head.bias.fill_(0.5)
        expected_values = reference(*token_rows(TINY_VOCAB))

    results = run_ranks(value_model_rank, 2, str(path), head_weight)

    expected_weights = dict(reference.model.named_parameters(prefix="model"))
    for result in results:
        report = result["report"]
        assert report.missing == ["value_head.weight", "value_head.bias"]
        assert report.unexpected == (0 if tied else 1)  # the untied lm_head.weight
        assert sorted(report.loaded) == sorted(expected_weights)
        for name, weight in expected_weights.items():
            assert torch.equal(result["weights"][name], weight), name
        torch.testing.assert_close(result["values"], expected_values, rtol=0, atol=1e-5)


def empty_shard_rank(rank, world_size, model_path):
    with parameters_on_meta():
        model = nn.Linear(4, 1)  # weight [1, 4] and bias [1]: rank 1's shards are empty
    fully_shard(model, mesh=dp_mesh(world_size).fsdp_mesh)
    report = load_sharded_weights(model, model_path, device=CPU)
    return {"report": report, "weights": full_weights(model)}


def test_rank_with_empty_shards_reads_nothing(tmp_path):
    state = {"weight": torch.arange(4.0).reshape(1, 4), "bias": torch.tensor([7.0])}
    save_file(state, tmp_path / "model.safetensors")

    results = run_ranks(empty_shard_rank, 2, str(tmp_path))

    assert [result["report"].bytes_read for result in results] == [20, 0]
    for result in results:
        assert sorted(result["report"].loaded) == ["bias", "weight"]
        for name, weight in state.items():
            assert torch.equal(result["weights"][name], weight), name


def test_bin_only_checkpoint_raises_with_the_fix(tmp_path):
    path = save_qwen3(tmp_path, tied=True)
    state = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    for file in path.glob("*.safetensors"):
        file.unlink()
    torch.save(state, path / "pytorch_model.bin")
    model = build_empty_model(str(path), dtype=torch.float32)
    with pytest.raises(ValueError, match="only pytorch_model.*bin weights.*convert them to safetensors"):
        load_sharded_weights(model, str(path), device=CPU)


def test_no_matching_names_raises(tmp_path):
    """A bare backbone's names lack the causal LM's 'model.' prefix: an error, not all-missing."""
    path = save_qwen3(tmp_path, tied=True)
    backbone = build_empty_model(str(path), dtype=torch.float32, auto_class=transformers.AutoModel)
    with pytest.raises(ValueError, match="no parameter name matches a checkpoint key.*ValueModel"):
        load_sharded_weights(backbone, str(path), device=CPU)
