"""Config loading, overrides and start-up validation."""

import ast
import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from molt.config import ConfigError, MoltConfig, apply_override, load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.py")


def test_recipe_functions_return_fresh_configs():
    first = load_config(DEMO)
    second = load_config(DEMO)
    first.rollout.temperature = 0.5
    assert second.rollout.temperature == 1.0
    assert load_config(f"{DEMO}:two_trainers").layout.num_trainer_ranks == 2


def test_overrides_are_typed():
    cfg = load_config(DEMO, ["train.learning_rate=3e-4", "rollout.n_samples_per_prompt=4",
                             "data.shuffle=false", "train.adam_betas=0.8,0.95", "name=x"])
    assert cfg.train.learning_rate == 3e-4 and isinstance(cfg.train.learning_rate, float)
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.data.shuffle is False
    assert cfg.train.adam_betas == (0.8, 0.95)
    assert cfg.name == "x"
    # A tuple of names takes a plain comma list as well as JSON.
    assert load_config(DEMO, ["train.no_weight_decay_on=norms,biases"]).train.no_weight_decay_on == ("norms", "biases")
    assert load_config(DEMO, ['train.no_weight_decay_on=["embeddings"]']).train.no_weight_decay_on == ("embeddings",)
    # X | None: the X's own spelling, or none/null.
    optional = load_config(DEMO, ["rollout.capture_routes=False", "algorithm.router_aux_loss_coef=0.01"])
    assert optional.rollout.capture_routes is False and optional.algorithm.router_aux_loss_coef == 0.01
    assert load_config(DEMO, ["rollout.capture_routes=none"]).rollout.capture_routes is None
    with pytest.raises(ConfigError, match="capture_routes='maybe': expected bool | None"):
        load_config(DEMO, ["rollout.capture_routes=maybe"])


@pytest.mark.parametrize("item, expected", [
    ("train.learnin_rate=1", "did you mean 'train.learning_rate'"),
    ("rollout.temprature=1", "did you mean 'rollout.temperature'"),
    ("trian.num_steps=1", "did you mean 'train.num_steps'"),
])
def test_unknown_key_names_the_closest(item, expected):
    with pytest.raises(ConfigError, match=expected):
        apply_override(MoltConfig(), item)


@pytest.mark.parametrize("item, expected", [
    ("train.num_steps=ten", "expected int"),
    ("data.shuffle=maybe", "expected bool"),
    ("train=3", "is a section"),
    ("train.num_steps", "expected KEY=VALUE"),
])
def test_bad_values_are_refused(item, expected):
    with pytest.raises(ConfigError, match=expected):
        apply_override(MoltConfig(), item)


def test_missing_recipe_function_lists_the_available_ones():
    with pytest.raises(ConfigError, match="no function 'nope'.*two_trainers"):
        load_config(f"{DEMO}:nope")


def _valid_config(tmp_path) -> MoltConfig:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "agent.py").write_text("")
    cfg = MoltConfig()
    cfg.model.path = str(tmp_path / "model")
    cfg.data.train_path = str(tmp_path / "train.jsonl")
    cfg.agent.path = str(tmp_path / "agent.py")
    return cfg


def test_a_valid_config_passes(tmp_path):
    validate_config(_valid_config(tmp_path), world_size=2)


def test_streaming_with_partial_rollout_and_importance_correction_passes(tmp_path):
    cfg = _valid_config(tmp_path)
    cfg.algorithm.max_staleness, cfg.rollout.partial_rollout = 2, True
    cfg.algorithm.importance_level, cfg.algorithm.importance_mode = "token", "trunc"
    validate_config(cfg, world_size=2)


@pytest.mark.parametrize("change, world_size, expected", [
    (lambda c: None, 3, r"num_trainer_ranks \+ layout.num_rollout_ranks = 1 \+ 1 = 2, but the job has 3"),
    (lambda c: setattr(c.rollout, "n_samples_per_prompt", 1), 2, "n_samples_per_prompt > 1"),
    (lambda c: setattr(c.agent, "path", "missing.py"), 2, "agent.path='missing.py' is not a file"),
    (lambda c: setattr(c.model, "path", "/nonexistent"), 2, "model.path='/nonexistent' has no config.json"),
    (lambda c: setattr(c.train, "max_tokens_per_micro_batch", 10), 2, "train.max_tokens_per_micro_batch=10"),
    (lambda c: setattr(c.metrics, "wandb_mode", "cloud"), 2, "metrics.wandb_mode='cloud'"),
    (lambda c: setattr(c.algorithm, "advantage_estimator", "ppo"), 2, "advantage_estimator='ppo'"),
    (lambda c: setattr(c.agent, "on_failed_rollout", "retry"), 2, "on_failed_rollout='retry': use drop_group or refill"),
    (lambda c: setattr(c.agent, "max_refills_per_group", -1), 2, "agent.max_refills_per_group=-1: must be >= 0"),
    (lambda c: (setattr(c.algorithm, "advantage_estimator", "rloo"), setattr(c.rollout, "n_samples_per_prompt", 1)),
     2, "advantage_estimator='rloo' needs rollout.n_samples_per_prompt > 1"),
    (lambda c: (setattr(c.algorithm, "importance_level", "seq"), setattr(c.algorithm, "importance_mode", "trunc")),
     2, "importance_level='seq' with importance_mode='trunc': seq and geo take only mask"),
    (lambda c: setattr(c.algorithm, "importance_band", (2.0, 2.0)), 2, r"importance_band=\(2.0, 2.0\): need 0 <= low < high"),
    (lambda c: setattr(c.algorithm, "importance_level", "row"), 2, "importance_level='row'"),
    (lambda c: setattr(c.algorithm, "max_staleness", 2), 2, "max_staleness=2 trains on tokens sampled by older"),
    (lambda c: (setattr(c.algorithm, "max_staleness", -1), setattr(c.algorithm, "importance_level", "token")),
     2, "algorithm.max_staleness=-1: must be >= 0"),
    (lambda c: setattr(c.rollout, "partial_rollout", True), 2,
     "rollout.partial_rollout=True .* needs algorithm.importance_level .* \\(algorithm.importance_level='off'\\)"),
    (lambda c: setattr(c.algorithm, "kl_estimator", "k4"), 2, "kl_estimator='k4': use k1, k2 or k3"),
    (lambda c: setattr(c.algorithm, "kl_target", 0.1), 2, "kl_target=0.1 adapts kl_coef, which is 0"),
    (lambda c: setattr(c.algorithm, "dual_clip", 0.5), 2, "dual_clip=0.5: use 0"),
    (lambda c: setattr(c.algorithm, "policy_loss", "grpo"), 2, "policy_loss='grpo': use one of ppo, gspo, cispo"),
    (lambda c: (setattr(c.algorithm, "policy_loss", "cispo"), setattr(c.algorithm, "dual_clip", 3.0)), 2,
     "dual_clip=3.0 caps PPO's token terms; algorithm.policy_loss='cispo' has none to cap"),
    (lambda c: setattr(c.algorithm, "gamma", 0.0), 2, r"algorithm.gamma=0.0: must be in \(0, 1\]"),
    (lambda c: setattr(c.rollout, "num_agent_workers", 0), 2, "rollout.num_agent_workers=0: need at least 1"),
    (lambda c: setattr(c.train, "param_dtype", "fp32"), 2, "train.param_dtype='fp32': use one of float32"),
    (lambda c: setattr(c.train, "compute_dtype", "bf16"), 2, "train.compute_dtype='bf16': use '' \\(model.dtype\\)"),
    (lambda c: setattr(c.train, "activation_checkpointing", "every_n:0"), 2,
     "train.activation_checkpointing='every_n:0': use none, full or every_n:<k> with k >= 1"),
    (lambda c: setattr(c.train, "activation_checkpointing", "some"), 2, "train.activation_checkpointing='some'"),
    (lambda c: setattr(c.train, "lr_schedule", "step"), 2, "train.lr_schedule='step': use one of constant, linear, cosine"),
    (lambda c: setattr(c.train, "warmup_steps", 101), 2, r"train.warmup_steps=101: must be in \[0, train.num_steps=100\]"),
    (lambda c: setattr(c.train, "min_lr_ratio", 1.5), 2, r"train.min_lr_ratio=1.5: must be in \[0, 1\]"),
    (lambda c: setattr(c.train, "no_weight_decay_on", ("norms", "gates")), 2, r"unknown \['gates'\]"),
    (lambda c: setattr(c.train, "mini_batches_per_step", 65), 2,
     r"train.mini_batches_per_step=65 exceeds the rollouts of a step \(.* = 64\)"),
    (lambda c: setattr(c.train, "ppo_epochs", 0), 2, "train.ppo_epochs=0: need at least 1"),
    (lambda c: setattr(c.train, "logprob_chunk_tokens", 0), 2, "train.logprob_chunk_tokens=0: need at least 1"),
    (lambda c: setattr(c.train, "max_consecutive_nonfinite_steps", 0), 2, "max_consecutive_nonfinite_steps=0"),
    (lambda c: setattr(c, "seed", -1), 2, "seed=-1: must be >= 0"),
    (lambda c: setattr(c.agent, "rollout_timeout_seconds", 0), 2, "agent.rollout_timeout_seconds=0: must be > 0"),
    (lambda c: setattr(c.rollout, "max_response_tokens", 0), 2, "rollout.max_response_tokens=0: need at least 1"),
    (lambda c: setattr(c.rollout, "engine_threads", -1), 2, "rollout.engine_threads=-1: must be >= 0"),
    (lambda c: setattr(c.rollout, "engine_start_timeout_seconds", 0.0), 2,
     "rollout.engine_start_timeout_seconds=0.0: must be > 0"),
    (lambda c: setattr(c.train, "adam_betas", (0.9, 1.0)), 2,
     r"train.adam_betas=\(0.9, 1.0\): each must be in \[0, 1\)"),
    (lambda c: setattr(c.train, "weight_decay", -0.1), 2, "train.weight_decay=-0.1: must be >= 0"),
    (lambda c: setattr(c.train, "max_grad_norm", -1.0), 2, "train.max_grad_norm=-1.0: must be >= 0"),
    (lambda c: setattr(c.algorithm, "clip_eps_low", 1.0), 2, r"algorithm.clip_eps_low=1.0: must be in \[0, 1\)"),
    (lambda c: setattr(c.algorithm, "clip_eps_high", -0.2), 2, "algorithm.clip_eps_high=-0.2: must be >= 0"),
    (lambda c: setattr(c.refit, "check_every_steps", -1), 2, "refit.check_every_steps=-1: must be >= 0"),
    (lambda c: (setattr(c, "device", "cpu"), setattr(c.train, "cpu_offload", True)), 2,
     "train.cpu_offload=True on a CPU run: it keeps parameters, gradients and AdamW state in host memory to save GPU"),
])
def test_validation_names_the_field(tmp_path, change, world_size, expected):
    cfg = _valid_config(tmp_path)
    change(cfg)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg, world_size=world_size)


def test_validation_reports_every_error_at_once(tmp_path):
    cfg = _valid_config(tmp_path)
    cfg.rollout.temperature = 0
    cfg.refit.timeout_seconds = -1
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    assert "rollout.temperature=0" in str(error.value) and "refit.timeout_seconds=-1" in str(error.value)


def test_config_cli_prints_the_resolved_config(tmp_path):
    cfg = _valid_config(tmp_path)
    sets = [f"model.path={cfg.model.path}", f"data.train_path={cfg.data.train_path}",
            f"agent.path={cfg.agent.path}", "train.num_steps=7"]
    args = [sys.executable, "-m", "molt.config", "--config", DEMO]
    for item in sets:
        args += ["--set", item]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)["train"]["num_steps"] == 7
    bad = subprocess.run(args + ["--set", "train.nm_steps=1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "did you mean 'train.num_steps'" in bad.stderr


@pytest.mark.parametrize("change, expected", [
    (lambda a: setattr(a, "filter_band", (1.0, 1.0)),
     r"algorithm.filter_band=\(1.0, 1.0\): needs \(low, high\) with low < high"),
    (lambda a: setattr(a, "filter_band", (0.5, 0.2)), r"algorithm.filter_band=\(0.5, 0.2\)"),
    (lambda a: setattr(a, "filter_band", (0.5,)),
     r"algorithm.filter_band=\(0.5,\): expected tuple\[float, float\], got \(float\)"),
    (lambda a: setattr(a, "max_backfill_prompts", -1), "algorithm.max_backfill_prompts=-1: must be >= 0"),
])
def test_group_filter_settings_are_validated(tmp_path, change, expected):
    cfg = _valid_config(tmp_path)
    validate_config(cfg)  # the defaults pass, filtering on or off
    cfg.algorithm.filter_groups = True
    validate_config(cfg)
    change(cfg.algorithm)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg)


def test_group_filter_needs_groups_of_more_than_one(tmp_path):
    cfg = _valid_config(tmp_path)
    cfg.rollout.n_samples_per_prompt = 1
    message = "algorithm.filter_groups=True needs rollout.n_samples_per_prompt > 1"
    with pytest.raises(ConfigError) as without_filter:  # the estimator objects too; the filter only when on
        validate_config(cfg)
    assert message not in str(without_filter.value)
    cfg.algorithm.filter_groups = True
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_group_filter_settings_are_set_from_the_command_line():
    cfg = MoltConfig()
    for item in ("algorithm.filter_groups=true", "algorithm.filter_band=0.1,0.9", "algorithm.max_backfill_prompts=8"):
        apply_override(cfg, item)
    algo = cfg.algorithm
    assert (algo.filter_groups, algo.filter_band, algo.max_backfill_prompts) == (True, (0.1, 0.9), 8)


@pytest.mark.parametrize("section, typo, expected", [
    ("", "nme", "'name'"),
    ("model", "dtpye", "'model.dtype'"),
    ("layout", "num_trainer_rank", "'layout.num_trainer_ranks'"),
    ("data", "train_pth", "'data.train_path'"),
    ("agent", "max_turn", "'agent.max_turns'"),
    ("rollout", "temprature", "'rollout.temperature'"),
    ("train", "lerning_rate", "'train.learning_rate'"),
    ("algorithm", "kl_coeff", "'algorithm.kl_coef'"),
    ("refit", "timeout_second", "'refit.timeout_seconds'"),
    ("payloads", "budget_megabyte", "'payloads.budget_megabytes'"),
    ("checkpoint", "keep_lst", "'checkpoint.keep_last'"),
    ("metrics", "wandb_mod", "'metrics.wandb_mode'"),
])
def test_a_recipe_typo_names_the_closest_field(section, typo, expected):
    cfg = MoltConfig()
    target = getattr(cfg, section) if section else cfg
    with pytest.raises(ConfigError, match=f"{section + '.' if section else ''}{typo}: {type(target).__name__} has no "
                                          f"field '{typo}'; did you mean {expected}"):
        setattr(target, typo, 1)
    assert typo not in vars(target)


def test_a_typo_in_a_recipe_file_fails_loading_it(tmp_path):
    recipe = tmp_path / "recipe.py"
    recipe.write_text("from molt.config import MoltConfig\n\n\ndef config():\n    cfg = MoltConfig()\n"
                      "    cfg.train.lerning_rate = 1e-4\n    return cfg\n")
    expected = r"--config '.*recipe.py': train.lerning_rate: .* did you mean 'train.learning_rate'"
    with pytest.raises(ConfigError, match=expected):
        load_config(str(recipe))


def test_guarded_sections_still_copy_replace_and_serialize():
    cfg = load_config(DEMO)
    twin = copy.deepcopy(cfg)
    assert twin == cfg and twin.train is not cfg.train
    twin.train.num_steps = 7  # fields stay assignable on copies
    assert dataclasses.replace(cfg.train, num_steps=7) == twin.train
    assert json.loads(json.dumps(cfg.to_dict()))["train"]["num_steps"] == cfg.train.num_steps


@pytest.mark.parametrize("section, name, value, expected", [
    ("train", "num_steps", "10", "train.num_steps='10': expected int, got str"),
    ("train", "learning_rate", "1e-4", "train.learning_rate='1e-4': expected float, got str"),
    ("agent", "max_turns", True, "agent.max_turns=True: expected int, got bool"),
    ("rollout", "prompts_per_step", 8.0, "rollout.prompts_per_step=8.0: expected int, got float"),
    ("data", "shuffle", 1, "data.shuffle=1: expected bool, got int"),
    ("train", "no_weight_decay_on", ["norms"],
     r"train.no_weight_decay_on=\['norms'\]: expected tuple\[str, ...\], got list"),
    ("algorithm", "importance_band", ("0.5", 2.0),
     r"algorithm.importance_band=\('0.5', 2.0\): expected tuple\[float, float\], got \(str, float\)"),
    ("", "layout", {"num_trainer_ranks": 1}, "layout={'num_trainer_ranks': 1}: expected LayoutConfig, got dict"),
])
def test_validation_checks_the_type_of_every_field(tmp_path, section, name, value, expected):
    cfg = _valid_config(tmp_path)
    setattr(getattr(cfg, section) if section else cfg, name, value)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg, world_size=2)


def test_a_float_field_takes_an_int(tmp_path):
    cfg = _valid_config(tmp_path)
    cfg.layout.gpu_memory_gigabytes, cfg.refit.bucket_megabytes = 79, 64
    validate_config(cfg, world_size=2)


def _recipe_specs() -> list[str]:
    """PATH:FUNCTION of every function in configs/*.py declared to return a MoltConfig."""
    specs = []
    for path in sorted((ROOT / "configs").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and ast.unparse(node.returns or ast.Constant(None)) == "MoltConfig":
                specs.append(f"{path}:{node.name}")
    return specs


@pytest.mark.parametrize("spec", _recipe_specs(), ids=lambda spec: Path(spec).name)
def test_every_shipped_recipe_validates(spec):
    cfg = load_config(spec)
    validate_config(cfg, world_size=cfg.world_size, require_files=False)
