"""`--dry-run` of the large recipes at their real world size, on CPU, with no checkpoint: ranks,
placement, the trainer mesh and bytes per rank; broken layouts fail naming the field."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from molt.config import ConfigError, load_config
from molt.distributed.placement import place_ranks
from molt.distributed.timeouts import trainer_group_timeout
from molt.dry_run import PROMPT_SAMPLE_ROWS, describe_placements, dry_run_report

ROOT = Path(__file__).resolve().parents[1]
QWEN3_RECIPE = ROOT / "configs" / "qwen3_30b_a3b_math_tool.py"
MOE_1T_RECIPE = ROOT / "configs" / "moe_1t.py"
QWEN3_1_7B_RECIPE = ROOT / "configs" / "qwen3_1_7b_math_tool.py"
GIB = 2**30


def run_dry_run(recipe: Path, *overrides: str, checkpoints: Path) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # The checkpoints are absent, as on a laptop: the dry run must read configs/hf instead.
    env.update(MOLT_CHECKPOINTS=str(checkpoints), MOLT_DATA=str(checkpoints))
    command = [sys.executable, "-m", "molt.train", "--config", str(recipe), "--dry-run"]
    for item in overrides:
        command += ["--set", item]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def hf_config(name: str) -> dict:
    return json.loads((ROOT / "configs" / "hf" / name / "config.json").read_text())


def qwen3_moe_params(c: dict) -> int:
    """Parameters of Qwen3MoeForCausalLM, counted by hand from its config (untied embeddings)."""
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    attention = (hidden * c["num_attention_heads"] * head_dim * 2  # q_proj, o_proj
                 + hidden * c["num_key_value_heads"] * head_dim * 2  # k_proj, v_proj
                 + 2 * head_dim)  # q_norm, k_norm
    experts = c["num_experts"] * 3 * hidden * c["moe_intermediate_size"]  # gate, up, down
    router = hidden * c["num_experts"]
    block = attention + experts + router + 2 * hidden  # two RMSNorms
    return c["num_hidden_layers"] * block + 2 * c["vocab_size"] * hidden + hidden


def deepseek_v3_params(c: dict) -> int:
    """Parameters of DeepseekV3ForCausalLM (MLA attention, first_k_dense_replace dense blocks)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (hidden * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * qk_head
                 + hidden * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
                 + heads * c["v_head_dim"] * hidden)
    dense_mlp = 3 * hidden * c["intermediate_size"]
    expert = 3 * hidden * c["moe_intermediate_size"]
    moe_mlp = (c["n_routed_experts"] + c["n_shared_experts"]) * expert + c["n_routed_experts"] * hidden
    num_dense = c["first_k_dense_replace"]
    blocks = (num_dense * (attention + dense_mlp + 2 * hidden)
              + (c["num_hidden_layers"] - num_dense) * (attention + moe_mlp + 2 * hidden))
    return blocks + 2 * c["vocab_size"] * hidden + hidden


def printed_params(stdout: str) -> int:
    return int(re.search(r"parameters: ([\d,]+) =", stdout)[1].replace(",", ""))


def printed_gib(stdout: str, row: str) -> float:
    return float(re.search(rf"^  {row}\s+([\d.]+) GiB", stdout, re.MULTILINE)[1])


def test_qwen3_30b_a3b_recipe_passes_dry_run(tmp_path):
    result = run_dry_run(QWEN3_RECIPE, checkpoints=tmp_path / "absent")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "layout: 16 ranks = 8 trainer + 8 rollout; 16 GPUs on 2 node(s) of 8" in out
    assert "rank 0: node 0, local rank 0, GPU 0: trainer (data-parallel rank 0/8) + rollout controller" in out
    assert "rank 7: node 0, local rank 7, GPU 7: trainer (data-parallel rank 7/8)" in out
    assert "rank 8: node 1, local rank 0, GPU 0: rollout: vLLM engine (tensor parallel 1)" in out
    assert "rank 15: node 1, local rank 7, GPU 7: rollout" in out
    assert "launch: torchrun --nnodes 2 --nproc_per_node 8" in out
    # Engine start scales with the 57 GiB bf16 checkpoint (300 s + 10 s per GiB), not a fixed 300 s.
    assert "trainer group timeout: 8,369 s (2.3 h) = engine start 989 s (120 s hellos + 869 s" in out
    assert "trainer mesh: DeviceMesh((dp_shard=8)" in out and "fake process group of 16 ranks" in out
    assert "dp_replicate 1 x dp_shard 8 x tp 1, 8 data-parallel rank(s)" in out
    assert "model: Qwen3MoeForCausalLM" in out and "(model.config_path)" in out
    expected = qwen3_moe_params(hf_config("qwen3-30b-a3b"))
    assert printed_params(out) == expected
    assert abs(expected - 30.5e9) < 0.05e9  # the published 30.5B
    # float32 master weights, 8 trainer ranks: shard = params / 8 (every sharded dim divides by 8),
    # x 4 bytes each for weights and gradients, x 8 for AdamW: 16 B/param.
    shard_gib = expected / 8 * 4 / GIB
    assert printed_gib(out, "parameters") == pytest.approx(shard_gib, abs=0.01)
    assert printed_gib(out, "gradients") == pytest.approx(shard_gib, abs=0.01)
    assert printed_gib(out, "AdamW states") == pytest.approx(2 * shard_gib, abs=0.01)
    assert "stored float32, 4 B/param; compute bfloat16" in out
    config = hf_config("qwen3-30b-a3b")
    head_gib = (3 * 1024 + config["hidden_size"]) * config["vocab_size"] * 4 / GIB
    assert printed_gib(out, "loss head") == pytest.approx(head_gib, abs=0.01)
    blocks_gib = config["num_hidden_layers"] * 16384 * config["hidden_size"] * 2 / GIB  # every block checkpointed
    assert printed_gib(out, "block inputs") == pytest.approx(blocks_gib, abs=0.01)
    assert "model.path='" + str(tmp_path / "absent" / "Qwen3-30B-A3B") + "': not on this machine" in out
    assert out.rstrip().endswith("ok: the config is valid for 16 ranks")


@pytest.mark.parametrize("function, ranks, placed, engine_start", [
    ("one_gpu", "2 ranks = 1 trainer + 1 rollout; 1 GPUs on 1 node(s) of 1",
     "  rank 1: node 0, local rank 1, GPU 0: rollout", "engine start 424 s (120 s hellos + 304 s"),
    ("one_node", "16 ranks = 8 trainer + 8 rollout; 8 GPUs on 1 node(s) of 8",
     "  rank 15: node 0, local rank 15, GPU 7: rollout", "engine start 452 s (120 s hellos + 332 s")])
def test_the_small_dense_recipes_pass_dry_run_colocated(tmp_path, function, ranks, placed, engine_start):
    """The 1-GPU and 1-node recipes: engines on the trainer ranks' GPUs, gloo refit, the memory split."""
    result = run_dry_run(Path(f"{QWEN3_1_7B_RECIPE}:{function}"), checkpoints=tmp_path / "absent")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"layout: {ranks} (layout.gpus_per_node)" in out
    assert placed in out
    assert "refit backend: gloo (refit.backend=auto, layout.colocate: NCCL refuses two ranks on one GPU)" in out
    assert "parameters: 1,720,574,976 = 1,720,574,976 dense" in out  # Qwen3-1.7B, tied embeddings
    # The engine start limit scales with the bf16 checkpoint (3.2 GiB) and the engines reading it at once.
    assert engine_start in out
    assert ("colocated: the trainer rank on each GPU has 51.4 GiB = (1 - rollout.engine_memory_fraction) x "
            "layout.gpu_memory_gigabytes") in out
    assert "ok: the config is valid" in out


def test_a_colocated_trainer_that_does_not_fit_beside_its_engine_fails_naming_the_field(tmp_path):
    result = run_dry_run(Path(f"{QWEN3_1_7B_RECIPE}:one_gpu"), "rollout.engine_memory_fraction=0.7",
                         checkpoints=tmp_path / "absent")
    assert result.returncode == 2
    assert "its engine leaves it 23.7 GiB of the GPU: lower rollout.engine_memory_fraction (now 0.7)" in result.stderr


def test_moe_1t_recipe_passes_dry_run(tmp_path):
    result = run_dry_run(MOE_1T_RECIPE, checkpoints=tmp_path / "absent")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "layout: 136 ranks = 128 trainer + 8 rollout; 192 GPUs on 24 node(s) of 8" in out
    assert "rank 127: node 15, local rank 7, GPU 7: trainer (data-parallel rank 127/128)" in out
    assert "rank 128: node 16, local rank 0, GPUs 0-7: rollout: vLLM engine (tensor parallel 8)" in out
    assert "rank 135: node 23, local rank 0, GPUs 0-7: rollout" in out
    assert ("launch: sbatch --nodes 24 launch/slurm_srun.sbatch ... (per-node task counts 8(x16),1(x8); "
            "torchrun cannot start this layout)") in out
    assert "trainer group timeout: 28,790 s (8.0 h)" in out
    assert "every rank checks its host, LOCAL_RANK and GPUs against this placement" in out
    assert "each rollout rank pins its engine to its GPUs with CUDA_VISIBLE_DEVICES" in out
    assert "trainer mesh: DeviceMesh((dp_shard=128)" in out and "fake process group of 136 ranks" in out
    expected = deepseek_v3_params(hf_config("moe-1t"))
    assert printed_params(out) == expected
    assert 1.0e12 < expected < 1.05e12
    shard_gib = expected / 128 * 4 / GIB  # float32 master weights: 16 B/param with gradients and AdamW
    assert printed_gib(out, "parameters") == pytest.approx(shard_gib, rel=1e-3)
    assert printed_gib(out, "AdamW states") == pytest.approx(2 * shard_gib, rel=1e-3)
    engine_gib = expected * 2 / 8 / GIB
    assert f"per engine GPU: ~{engine_gib:.2f} GiB" in out
    assert out.rstrip().endswith("ok: the config is valid for 136 ranks")


@pytest.mark.parametrize("overrides, expected", [
    (["layout.num_trainer_ranks=0"], ["layout.num_trainer_ranks=0: need at least 1"]),
    (["layout.engine_tensor_parallel_size=3"],
     ["layout.engine_tensor_parallel_size=3 does not divide layout.gpus_per_node=8"]),
    # 60 trainer GPUs: the 1st engine would take GPUs 4-11 of node 7.
    (["layout.num_trainer_ranks=60"],
     ["make layout.num_trainer_ranks=60 a multiple of layout.engine_tensor_parallel_size=8"]),
    # 64 trainer ranks: 16 B/param of float32 master state is ~240 GiB per rank before the gathered block.
    (["layout.num_trainer_ranks=64"], ["raise layout.num_trainer_ranks (now 64) to shard finer, or set train.cpu_offload"]),
    (["model.config_path="], ["model.config_path is empty"]),
    # 141 GB H200s (131 GiB): neither 1/128 of the training state nor 1/8 of the bf16 weights fits.
    (["layout.gpu_memory_gigabytes=131"],
     ["raise layout.num_trainer_ranks (now 128)", "raise layout.engine_tensor_parallel_size (now 8"]),
])
def test_broken_layout_fails_naming_the_field(tmp_path, overrides, expected):
    result = run_dry_run(MOE_1T_RECIPE, *overrides, checkpoints=tmp_path / "absent")
    assert result.returncode == 2
    assert "ok: the config is valid" not in result.stdout
    for text in expected:
        assert text in result.stderr


def placement_lines(recipe: Path, monkeypatch) -> list[str]:
    monkeypatch.setenv("MOLT_CHECKPOINTS", "/absent")
    cfg = load_config(str(recipe), [])
    return list(describe_placements(cfg, place_ranks(cfg.layout)))


def test_the_dry_run_names_the_launcher_and_the_timeout(monkeypatch):
    lines = placement_lines(MOE_1T_RECIPE, monkeypatch)
    assert "  node 16: 1 process(es), ranks 128, GPUs 0-7" in lines
    assert ("launch: sbatch --nodes 24 launch/slurm_srun.sbatch ... (per-node task counts 8(x16),1(x8); "
            "torchrun cannot start this layout)") in lines
    timeout = next(line for line in lines if line.startswith("trainer group timeout:"))
    assert timeout.startswith("trainer group timeout: 26,400 s (7.3 h) = engine start 420 s")
    assert "refit 21,600 s (refit.max_attempts=2 x (attempt + group build: 3 x refit.timeout_seconds=3600))" in timeout
    lines = placement_lines(QWEN3_RECIPE, monkeypatch)
    assert ("launch: torchrun --nnodes 2 --nproc_per_node 8 -m molt.train --config ... (under Slurm: sbatch "
            "--nodes 2 launch/slurm.sbatch ...)") in lines


def test_the_trainer_group_outwaits_the_refits_and_the_rollouts(monkeypatch):
    monkeypatch.setenv("MOLT_CHECKPOINTS", "/absent")
    cfg = load_config(str(MOE_1T_RECIPE), [])
    timeout = trainer_group_timeout(cfg)
    refit, agent = cfg.refit, cfg.agent
    # Every refit attempt, each with a refit-group build (rendezvous + joins), while ranks 1.. wait.
    assert timeout.refit_seconds == refit.max_attempts * 3 * refit.timeout_seconds == 21600
    assert timeout.engine_start_seconds == 120 + 300  # auto, no checkpoint here: 300 s + 10 s per GiB of nothing
    assert timeout.batch_seconds == agent.rollout_timeout_seconds * 2 + 60 + cfg.payloads.fetch_timeout_seconds
    assert timeout.total_seconds == 420 + 21600 + 3780 + 600
    assert timeout.total_seconds > refit.max_attempts * refit.timeout_seconds + agent.rollout_timeout_seconds
    assert timeout.total_seconds > 30 * 60  # torch's default, which the 1T refit alone outlasts
    # The refit check's scoring on the engines counts only when it runs; more attempts, more time.
    cfg.refit.check_every_steps, cfg.refit.max_attempts = 5, 3
    assert trainer_group_timeout(cfg).refit_seconds == 3 * 3 * 3600 + 3600


def test_an_hsdp_layout_shows_its_replicas_and_shards(tmp_path):
    """The mesh line is read from the mesh the dry run built: 2 replicas of 4 FSDP2 shards."""
    # Shards of 4 ranks hold twice the state of 8: the recipe's 79 GiB check would refuse it.
    result = run_dry_run(QWEN3_RECIPE, "layout.trainer_data_parallel_replicate=2", "layout.gpu_memory_gigabytes=0",
                         checkpoints=tmp_path / "absent")
    assert result.returncode == 0, result.stderr
    assert "trainer mesh: DeviceMesh((dp_replicate=2, dp_shard=4)" in result.stdout
    assert "dp_replicate 2 x dp_shard 4 x tp 1, 8 data-parallel rank(s)" in result.stdout


def demo_dry_run(tmp_path, model_dir, rows: list[str]) -> list[str]:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(row + "\n" for row in rows))
    cfg = load_config(str(ROOT / "configs" / "demo.py"), [f"model.path={model_dir}", f"data.train_path={path}",
                                                               "eval.every_steps=0"])
    return list(dry_run_report(cfg))


def test_the_dry_run_checks_a_sample_of_the_prompt_rows(tmp_path, tiny_model_dir, caplog):
    good = '{"prompt": "1+1=", "label": "2"}'
    with caplog.at_level("WARNING", logger="molt"):
        lines = demo_dry_run(tmp_path, tiny_model_dir, [good, '{"prompt": "1+2=", "answer": "3"}'])
    assert "  data.train_path: the first 2 row(s) are valid prompt rows (the job checks every row before it starts)" \
        in lines
    path = tmp_path / "rows.jsonl"
    (warning,) = [record.getMessage() for record in caplog.records if record.name == "molt"]
    assert warning.startswith(f"{path}:2: key 'answer' (in 1 row(s)) is not a prompt-row key and is ignored "
                              "(did you mean 'label'?)")
    with pytest.raises(ConfigError, match=f"data.train_path: {path}:3: messages\\[0\\] has role 'robot'"):
        demo_dry_run(tmp_path, tiny_model_dir, [good, "", '{"messages": [{"role": "robot", "content": "hi"}]}'])
    # Past the sample the dry run reads nothing (the job reads every row before it starts).
    lines = demo_dry_run(tmp_path, tiny_model_dir, [good] * PROMPT_SAMPLE_ROWS + ["not json"])
    assert f"  data.train_path: the first {PROMPT_SAMPLE_ROWS:,} row(s) are valid prompt rows" in lines[-2]
