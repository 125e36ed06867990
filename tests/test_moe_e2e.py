"""The MoE demo recipe (configs/demo.py:moe) on the tiny Qwen3-MoE: a real torchrun job whose refits
reach every expert in the vLLM engine (the refit log-prob check after each step); the names the
refit and the HF export give the trainer's fused expert parameters; the dry run's dense /
routed-expert parameter count."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from distributed import run_ranks
from test_export_hf import PROBE, _load_tool, _train_and_save
from test_refit import refit_outside_vllm
from test_train_e2e import DEMO, VARIED_AGENT, _job_sets, _torchrun
from transformers import AutoConfig

from molt.config import load_config
from molt.dry_run import dry_run_report
from molt.models.hf_checkpoint import SAFETENSORS_FILE, build_empty_model, load_sharded_weights
from molt.refit.gloo import RefitSender
from molt.trainer.scoring import compute_token_logprobs

ROOT = Path(__file__).resolve().parents[1]
MOE_RECIPE = f"{DEMO}:moe"


def moe_param_counts(model_dir: Path) -> tuple[int, int, int]:
    """(dense, routed-expert, active per token) parameters of the tiny Qwen3MoeForCausalLM, counted
    by hand from its config (tied embeddings, every layer sparse)."""
    c = AutoConfig.from_pretrained(model_dir)  # config.json says num_local_experts; the config maps it
    hidden, head_dim = c.hidden_size, c.head_dim
    attention = (hidden * c.num_attention_heads * head_dim * 2  # q_proj, o_proj
                 + hidden * c.num_key_value_heads * head_dim * 2  # k_proj, v_proj
                 + 2 * head_dim)  # q_norm, k_norm
    router = hidden * c.num_experts
    dense = c.num_hidden_layers * (attention + router + 2 * hidden) + c.vocab_size * hidden + hidden
    expert = 3 * hidden * c.moe_intermediate_size  # gate, up, down
    routed = c.num_hidden_layers * c.num_experts * expert
    active = dense + c.num_hidden_layers * c.num_experts_per_tok * expert
    return dense, routed, active


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / SAFETENSORS_FILE, framework="pt") as checkpoint:
        return {key: checkpoint.get_tensor(key) for key in checkpoint.keys()}


def test_the_dry_run_counts_dense_and_routed_expert_parameters(tmp_path, moe_model_dir, demo_data_dir):
    cfg = load_config(MOE_RECIPE, [f"model.path={moe_model_dir}",
                                   f"data.train_path={Path(demo_data_dir) / 'train.jsonl'}"])
    lines = list(dry_run_report(cfg))
    dense, routed, active = moe_param_counts(moe_model_dir)
    assert routed > dense  # the experts are most of the model, so a swapped count cannot pass
    expected = (f"  parameters: {dense + routed:,} = {dense:,} dense + {routed:,} routed-expert; "
                f"{active:,} active per token")
    assert expected in lines, [line for line in lines if "parameters:" in line]
    assert any(line.startswith("model: Qwen3MoeForCausalLM") for line in lines)


def test_a_refit_sends_the_fused_experts_as_the_checkpoint_stored_them(moe_model_dir):
    """The trainer holds transformers' fused experts (gate_up_proj [experts, 2 x inter, hidden],
    down_proj [experts, hidden, inter]); the refit sends what the checkpoint holds, one tensor per
    expert and projection, which is what vLLM loaded from disk. Loading (per expert -> fused) and
    sending (fused -> per expert) round-trip exactly. Buckets of 100 KiB split each fused parameter
    (512 KiB) over several buckets."""
    model = build_empty_model(str(moe_model_dir), dtype=torch.float32)
    load_sharded_weights(model, str(moe_model_dir), device=torch.device("cpu"))
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 256, 128)  # fused in the trainer
    _, _, received = refit_outside_vllm(RefitSender(model, is_sender=True, bucket_bytes=100 << 10, timeout_seconds=30))
    stored = checkpoint_tensors(moe_model_dir)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in stored  # per expert on disk
    assert received.keys() == stored.keys()
    for key, tensor in stored.items():
        assert torch.equal(received[key], tensor), key


def test_an_exported_moe_checkpoint_keeps_the_per_expert_layout(tmp_path, moe_model_dir):
    """tools/export_hf.py on a checkpoint of 2 FSDP2 ranks' perturbed MoE weights writes the keys and
    shapes of the original checkpoint (per expert, as vLLM loads them; the trainer's fused tensors
    are split back), and transformers scores the export like the trainer."""
    from transformers import AutoModelForCausalLM

    trainer_logprobs = run_ranks(_train_and_save, 2, str(moe_model_dir), str(tmp_path / "ckpt"))[0]
    out = _load_tool().export_hf(tmp_path / "ckpt" / "step_00000005", tmp_path / "hf")
    exported, original = checkpoint_tensors(out), checkpoint_tensors(moe_model_dir)
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in original.items()}
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        scored = compute_token_logprobs(AutoModelForCausalLM.from_pretrained(out), ids, torch.ones_like(ids),
                                        temperature=1.0)[0].tolist()
    assert max(abs(a - b) for a, b in zip(scored, trainer_logprobs)) <= 1e-5
    assert any(not torch.equal(exported[key], original[key]) for key in original)  # the weights did change


@pytest.mark.e2e
@pytest.mark.timeout(600)  # above the job's own 420 s limit
def test_the_moe_recipe_trains_and_every_refit_reaches_the_experts(tmp_path, moe_model_dir, demo_data_dir):
    """Three streaming steps of the recipe (an Env whose reward varies within a group, so every step
    has a gradient); after each one's refit the engine scores a probe like the trainer, within 1e-4.
    An expert the refit missed, loaded into the wrong slot or left unpacked for the CPU kernel fails
    the check (experts left unpacked gave gaps of 0.15-0.18). Routes are captured (the MoE default)
    and replayed: every position that predicts a sampled token has one (R3 coverage 1), the trainer's
    routers agree with the engine's on the first step's tokens (fp32 both), and no trained token
    differs from a sampled one."""
    out = tmp_path / "run"
    sets = _job_sets(moe_model_dir, demo_data_dir, out, **{
        "agent.path": VARIED_AGENT, "refit.check_every_steps": 1, "train.learning_rate": 1e-3,
        "rollout.max_response_tokens": 4, "algorithm.max_staleness": 1, "rollout.partial_rollout": True,
        "algorithm.routing_replay": True})
    done = _torchrun(2, MOE_RECIPE, sets)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0, row
        assert row["policy_version"] == row["step"], row  # each step pushed its weights
        assert row["diagnostics/r3_coverage"] == 1.0 and row["rollout/unrouted_tokens"] == 0, row
        assert row["diagnostics/token_mismatches"] == 0 and row["diagnostics/model_input_mismatches"] == 0, row
    # Step 1 trains on tokens its own weights sampled: the routers agree but for near ties. Later steps
    # train on tokens sampled one version back, whose routes the update has moved (0.32-0.92 seen).
    assert steps[0]["diagnostics/route_alignment"] > 0.95, steps[0]
    gaps = [r["refit/max_abs_logprob_diff"] for r in rows if "refit/max_abs_logprob_diff" in r]
    assert len(gaps) == 4 and all(gap <= 1e-4 for gap in gaps), gaps  # before training, and after each step
