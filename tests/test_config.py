"""Config loading, overrides and start-up validation."""

import ast
import copy
import dataclasses
import json
import logging
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from molt import objectives
from molt.config import AlgorithmConfig, ConfigError, MoltConfig, apply_override, load_config, validate_config
from molt.config.fields import field_type_errors

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


def test_loss_aggregations_and_the_trust_region_pass_with_gspo(tmp_path):
    """GSPO with its own aggregation (the mean of the sequences' token means), the trust region on top
    of token-level TIS, and the constant aggregation with its own divisor, all validate."""
    cfg = _valid_config(tmp_path)
    cfg.algorithm.policy_loss, cfg.algorithm.loss_aggregation = "gspo", "seq_mean_token_mean"
    cfg.algorithm.importance_level, cfg.algorithm.importance_mode = "token", "trunc"
    cfg.algorithm.trust_region_kl = 1e-3
    validate_config(cfg, world_size=2)
    cfg.algorithm.loss_aggregation, cfg.algorithm.loss_constant_tokens = "constant", 512
    validate_config(cfg, world_size=2)
    # One definition of the words (molt.choices): the config's field takes the objectives' own.
    assert typing.get_args(typing.get_type_hints(AlgorithmConfig)["loss_aggregation"]) == objectives.LOSS_AGGREGATIONS


@pytest.mark.parametrize("change, world_size, expected", [
    (lambda c: None, 3, r"num_trainer_ranks \+ layout.num_rollout_ranks = 1 \+ 1 = 2, but the job has 3"),
    (lambda c: setattr(c.rollout, "n_samples_per_prompt", 1), 2, "n_samples_per_prompt > 1"),
    (lambda c: setattr(c.agent, "path", "missing.py"), 2, "agent.path='missing.py' is not a file"),
    (lambda c: setattr(c.model, "path", "/nonexistent"), 2, "model.path='/nonexistent' has no config.json"),
    (lambda c: setattr(c.train, "max_tokens_per_micro_batch", 10), 2, "train.max_tokens_per_micro_batch=10"),
    (lambda c: setattr(c.metrics, "wandb_mode", "cloud"), 2, "metrics.wandb_mode='cloud'"),
    (lambda c: setattr(c.algorithm, "advantage_estimator", "ppo"), 2, "advantage_estimator='ppo'"),
    (lambda c: setattr(c.agent, "on_failed_rollout", "retry"), 2,
     "on_failed_rollout='retry': use one of drop_group, refill; did you mean 'refill'"),
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
    (lambda c: setattr(c.algorithm, "kl_estimator", "k4"), 2,
     "kl_estimator='k4': use one of k1, k2, k3; did you mean 'k3'"),
    (lambda c: setattr(c.algorithm, "kl_target", 0.1), 2, "kl_target=0.1 adapts kl_coef, which is 0"),
    (lambda c: setattr(c.algorithm, "dual_clip", 0.5), 2, "dual_clip=0.5: use 0"),
    (lambda c: setattr(c.algorithm, "policy_loss", "grpo"), 2, "policy_loss='grpo': use one of ppo, gspo, cispo"),
    (lambda c: (setattr(c.algorithm, "policy_loss", "cispo"), setattr(c.algorithm, "dual_clip", 3.0)), 2,
     "dual_clip=3.0 caps PPO's token terms; algorithm.policy_loss='cispo' has none to cap"),
    (lambda c: setattr(c.algorithm, "loss_aggregation", "seq_mean"), 2,
     "algorithm.loss_aggregation='seq_mean': use one of token_mean, seq_mean_token_mean, constant"),
    (lambda c: (setattr(c.algorithm, "loss_aggregation", "constant"), setattr(c.algorithm, "loss_constant_tokens", -8)),
     2, r"algorithm.loss_constant_tokens=-8: must be >= 0 \(0 = rollout.max_response_tokens\)"),
    (lambda c: setattr(c.algorithm, "loss_constant_tokens", 512), 2,
     "loss_constant_tokens=512 sets the constant aggregation's divisor, which algorithm.loss_aggregation='token_mean' "
     "does not use"),
    (lambda c: setattr(c.algorithm, "trust_region_kl", -0.001), 2, r"algorithm.trust_region_kl=-0.001: must be >= 0"),
    (lambda c: setattr(c.algorithm, "trust_region_weight_cap", 0.5), 2,
     "algorithm.trust_region_weight_cap=0.5: must be >= 1"),
    (lambda c: (setattr(c.algorithm, "trust_region_kl", 0.001), setattr(c.algorithm, "importance_level", "geo"),
                setattr(c.algorithm, "importance_mode", "mask")), 2,
     "algorithm.trust_region_kl=0.001 rejects sequences by their KL and algorithm.importance_level='geo' rejects "
     "them by their ratio: use one rule"),
    (lambda c: setattr(c.algorithm, "gamma", 0.0), 2, r"algorithm.gamma=0.0: must be in \(0, 1\]"),
    (lambda c: setattr(c.rollout, "num_agent_workers", 0), 2, "rollout.num_agent_workers=0: need at least 1"),
    (lambda c: setattr(c.train, "param_dtype", "fp32"), 2, "train.param_dtype='fp32': use one of float32"),
    (lambda c: setattr(c.train, "compute_dtype", "bf16"), 2,
     "train.compute_dtype='bf16': use one of '', float32, .*; did you mean 'bfloat16'"),
    (lambda c: setattr(c.train, "activation_checkpointing", "every_n:0"), 2,
     "train.activation_checkpointing='every_n:0': use none, full or every_n:<k> with k >= 1"),
    (lambda c: setattr(c.train, "activation_checkpointing", "some"), 2, "train.activation_checkpointing='some'"),
    (lambda c: setattr(c.train, "lr_schedule", "step"), 2, "train.lr_schedule='step': use one of constant, linear, cosine"),
    (lambda c: setattr(c.train, "warmup_steps", -1), 2, r"train.warmup_steps=-1: must be >= 0"),
    (lambda c: setattr(c.train, "min_lr_ratio", 1.5), 2, r"train.min_lr_ratio=1.5: must be in \[0, 1\]"),
    (lambda c: setattr(c.train, "lr_multipliers", {"model.vision_model.": 0}), 2,
     r"train.lr_multipliers=\{'model.vision_model.': 0\}: each factor must be a number > 0"),
    (lambda c: setattr(c.train, "no_weight_decay_on", ("norms", "gates")), 2,
     r"train.no_weight_decay_on\[1\]='gates': use one of norms, biases, embeddings"),
    (lambda c: setattr(c.train, "mini_batches_per_step", 65), 2,
     r"train.mini_batches_per_step=65 exceeds the rollouts of a step \(.* = 64\)"),
    (lambda c: setattr(c.train, "ppo_epochs", 0), 2, "train.ppo_epochs=0: need at least 1"),
    (lambda c: setattr(c.train, "logprob_chunk_tokens", 0), 2, "train.logprob_chunk_tokens=0: need at least 1"),
    (lambda c: setattr(c.train, "max_consecutive_nonfinite_steps", 0), 2, "max_consecutive_nonfinite_steps=0"),
    (lambda c: setattr(c, "seed", -1), 2, "seed=-1: must be >= 0"),
    (lambda c: setattr(c.agent, "rollout_timeout_seconds", 0), 2, "agent.rollout_timeout_seconds=0: must be > 0"),
    (lambda c: setattr(c.rollout, "max_response_tokens", 0), 2, "rollout.max_response_tokens=0: need at least 1"),
    (lambda c: setattr(c.rollout, "engine_threads", -1), 2, "rollout.engine_threads=-1: must be >= 0"),
    (lambda c: setattr(c.rollout, "engine_start_timeout_seconds", -1.0), 2,
     "rollout.engine_start_timeout_seconds=-1.0: must be > 0, or 0 for auto"),
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
            f"agent.path={cfg.agent.path}", "train.num_steps=7", "eval.every_steps=0",
            "train.warmup_steps=0"]
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
            if (isinstance(node, ast.FunctionDef) and not node.name.startswith("_")  # a private helper is no recipe
                    and ast.unparse(node.returns or ast.Constant(None)) == "MoltConfig"):
                specs.append(f"{path}:{node.name}")
    return specs


@pytest.mark.parametrize("spec", _recipe_specs(), ids=lambda spec: Path(spec).name)
def test_every_shipped_recipe_validates(spec):
    cfg = load_config(spec)
    validate_config(cfg, world_size=cfg.world_size, require_files=False)


@pytest.mark.parametrize("fields, expected", [
    ({"every_steps": -1}, r"eval.every_steps=-1: must be >= 0 \(0 = off\)"),
    ({"every_steps": 10}, r"eval.every_steps=10 needs an eval set: set eval.data_path, or eval.holdout_rows"),
    ({"n_samples": 0}, r"eval.n_samples=0: need at least 1"),
    ({"temperature": 0.0}, r"eval.temperature=0.0: must be > 0"),
    ({"top_p": 1.5}, r"eval.top_p=1.5: must be in \(0, 1\]"),
    ({"top_p": 0.0}, r"eval.top_p=0.0: must be in \(0, 1\]"),
    ({"max_response_tokens": -2}, r"eval.max_response_tokens=-2: must be >= 0"),
    ({"max_response_tokens": 1024}, r"eval.max_response_tokens=1024 must be below rollout.max_length=1024"),
    ({"max_prompts": -1}, r"eval.max_prompts=-1: must be >= 0"),
    ({"holdout_rows": -5}, r"eval.holdout_rows=-5: must be >= 0"),
    ({"data_path": "no/such/eval.jsonl", "every_steps": 5}, r"eval.data_path='no/such/eval.jsonl' is not a file"),
    ({"data_path": "EVAL", "holdout_rows": 3}, r"eval.data_path=.* and eval.holdout_rows=3 both name the eval set"),
])
def test_eval_settings_are_validated(tmp_path, fields, expected):
    cfg = _valid_config(tmp_path)
    (tmp_path / "eval.jsonl").write_text("")
    cfg.eval.every_steps, cfg.eval.data_path = 10, str(tmp_path / "eval.jsonl")
    validate_config(cfg)  # an eval every 10 steps on a file passes
    cfg.eval.every_steps, cfg.eval.data_path = 0, ""
    for name, value in fields.items():
        setattr(cfg.eval, name, str(tmp_path / "eval.jsonl") if value == "EVAL" else value)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg)


def test_an_eval_file_is_required_only_when_training_evaluates(tmp_path):
    """A recipe's eval file may be absent while its evaluation is off (e.g. --set eval.every_steps=0)."""
    cfg = _valid_config(tmp_path)
    cfg.eval.data_path = str(tmp_path / "absent.jsonl")
    validate_config(cfg)
    cfg.eval.every_steps = 50
    with pytest.raises(ConfigError, match="absent.jsonl' is not a file"):
        validate_config(cfg)


@pytest.mark.parametrize("change, expected", [
    (lambda a: setattr(a, "overlong_buffer_tokens", 65),
     r"algorithm.overlong_buffer_tokens=65: must be in \[0, rollout.max_response_tokens=64\]"),
    (lambda a: setattr(a, "overlong_buffer_tokens", -1), r"algorithm.overlong_buffer_tokens=-1: must be in \[0, "),
    (lambda a: setattr(a, "overlong_penalty_factor", -0.5), "algorithm.overlong_penalty_factor=-0.5: must be >= 0"),
    (lambda a: setattr(a, "kl_clamp", -1.0), r"algorithm.kl_clamp=-1.0: must be >= 0 \(0 = uncapped\)"),
])
def test_overlong_and_kl_clamp_settings_are_validated(tmp_path, change, expected):
    cfg = _valid_config(tmp_path)
    algo = cfg.algorithm
    algo.overlong_filter, algo.overlong_buffer_tokens, algo.overlong_penalty_factor = True, 64, 0.0
    algo.kl_clamp = 0.0
    validate_config(cfg)  # the whole response as the buffer, no penalty, no cap: all allowed
    change(algo)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg)


@pytest.mark.parametrize("estimator, placement, coef, warned", [
    ("k1", "loss", 0.1, True), ("k3", "loss", 0.1, False), ("k2", "loss", 0.1, False),
    ("k1", "reward", 0.1, False), ("k1", "loss", 0.0, False),
])
def test_k1_in_the_loss_is_warned_about(estimator, placement, coef, warned):
    from molt.config import config_warnings

    cfg = MoltConfig()
    cfg.algorithm.kl_estimator, cfg.algorithm.kl_placement, cfg.algorithm.kl_coef = estimator, placement, coef
    warnings = config_warnings(cfg)
    assert len(warnings) == int(warned)
    if warned:
        for text in ("algorithm.kl_estimator='k1'", "kl_placement='loss'", "kl_coef=0.1", "'k3'", "'reward'"):
            assert text in warnings[0]


def test_a_warmup_longer_than_the_run_is_warned_about_not_refused(tmp_path):
    from molt.config import config_warnings

    cfg = _valid_config(tmp_path)
    cfg.train.num_steps, cfg.train.warmup_steps = 5, 10
    validate_config(cfg)
    assert [w for w in config_warnings(cfg) if w.startswith("train.warmup_steps=10 is more than train.num_steps=5")]
    cfg.train.warmup_steps = 5
    assert not [w for w in config_warnings(cfg) if "warmup" in w]


def test_start_up_logs_the_k1_warning_once(tmp_path, monkeypatch, caplog):
    from molt.train import main

    cfg = _valid_config(tmp_path)
    recipe = tmp_path / "recipe.py"
    recipe.write_text("from molt.config import MoltConfig\n\n\ndef config() -> MoltConfig:\n"
                      "    cfg = MoltConfig()\n    cfg.algorithm.kl_estimator = 'k1'\n"
                      "    cfg.algorithm.kl_coef = 0.05\n    return cfg\n")
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    molt_logger = logging.getLogger("molt")  # main() adds its console handler: removed after the test
    monkeypatch.setattr(molt_logger, "handlers", list(molt_logger.handlers))
    monkeypatch.setattr(molt_logger, "level", molt_logger.level)
    sets = [f"model.path={cfg.model.path}", f"data.train_path={cfg.data.train_path}", f"agent.path={cfg.agent.path}"]
    with caplog.at_level("WARNING", logger="molt"):
        # Not under torchrun: main stops with 2 after the start-up checks and warnings.
        assert main(["--config", str(recipe), *[a for item in sets for a in ("--set", item)]]) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([w for w in warnings if "algorithm.kl_estimator='k1'" in w]) == 1, caplog.text
    assert "must run under torchrun" in caplog.text


@pytest.mark.parametrize("change, expected", [
    (lambda c: setattr(c.sft, "num_steps", -1), r"sft.num_steps=-1: must be >= 0 \(0 = sft.epochs"),
    (lambda c: setattr(c.sft, "epochs", 0), "sft.epochs=0: need at least 1"),
    (lambda c: setattr(c.sft, "batch_size", 0), "sft.batch_size=0: need at least 1 row a step"),
])
def test_sft_ranges_are_refused_at_start_up(tmp_path, change, expected):
    cfg = _valid_config(tmp_path)
    change(cfg)
    with pytest.raises(ConfigError, match=expected):
        validate_config(cfg, world_size=2)


@pytest.mark.parametrize("change, world_size, expected", [
    (lambda c: setattr(c.sft, "data_path", ""), 1, r"sft.data_path='' is not a file"),
    (lambda c: setattr(c.sft, "batch_size", 0), 1, "sft.batch_size=0: need at least 1 row a step"),
    (lambda c: setattr(c.model, "path", "nowhere"), 1, r"model.path='nowhere' has no config.json"),
    (lambda c: (setattr(c.sft, "num_steps", 5), setattr(c.train, "warmup_steps", 6)), 1,
     "train.warmup_steps=6: must be at most sft.num_steps=5"),
    (lambda c: setattr(c.layout, "trainer_tensor_parallel_size", 2), 3,
     "layout.num_trainer_ranks=3 is not a multiple of"),
])
def test_sft_run_validation_names_the_field(tmp_path, change, world_size, expected):
    from molt.sft import validate_sft_config

    cfg = _valid_config(tmp_path)
    cfg.sft.data_path = cfg.data.train_path
    validate_sft_config(cfg, world_size=1)  # agent.path and data.train_path are RL's: not needed
    cfg.agent.path = cfg.data.train_path = ""
    validate_sft_config(cfg, world_size=1)
    change(cfg)
    with pytest.raises(ConfigError, match=expected):
        validate_sft_config(cfg, world_size=world_size)


def test_engine_parallelism_that_adds_workers_per_engine_is_refused():
    # prefill_context_parallel_size adds workers to each engine; decode_context_parallel_size does not:
    # vLLM's workers per engine are PP x TP x PCP (vllm/config/parallel.py, ParallelConfig.__post_init__)
    # and its NCCL weight receiver ranks them from Molt's offset 1 + engine x TP (vllm/distributed/
    # weight_transfer/nccl_common.py, worker_init_process_group), so PCP workers take the next engine's ranks.
    from vllm.config import ParallelConfig

    from molt.config.engine_args import engine_args_errors

    assert ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2).world_size == 4
    assert ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2).world_size == 2
    [error] = engine_args_errors({"prefill_context_parallel_size": 2})
    assert error.startswith("rollout.engine_args['prefill_context_parallel_size']: Molt sets this vLLM argument "
                            "itself; refit ranks count tensor-parallel workers only (1 + engine x TP + worker)")
    assert error.endswith("set layout.engine_tensor_parallel_size")
    assert engine_args_errors({"decode_context_parallel_size": 2}) == []


def _words(hint) -> tuple:
    """The words a Literal field (or a tuple of Literal words) takes; () for any other field."""
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()


def _word_fields(cls=MoltConfig, prefix: str = "") -> list[tuple[str, object]]:
    """(key, annotation) of every config field that takes words from a fixed set."""
    found = []
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            found += _word_fields(hint, f"{prefix}{name}.")
        elif _words(hint):
            found.append((prefix + name, hint))
    return found


WORD_FIELDS = _word_fields()


def test_every_field_of_words_is_a_literal():
    """The fields that take one of a fixed set of words, each declared as a Literal (and so under the
    one rule below); a new word field declared as a free str would be missing here."""
    assert {key for key, _ in WORD_FIELDS} == {
        "device", "model.dtype", "agent.on_failed_rollout", "agent.on_context_exhausted", "train.lr_schedule",
        "train.no_weight_decay_on", "train.param_dtype", "train.compute_dtype", "algorithm.advantage_estimator",
        "algorithm.policy_loss", "algorithm.loss_aggregation", "algorithm.importance_level",
        "algorithm.importance_mode", "algorithm.kl_estimator", "algorithm.kl_placement", "refit.backend",
        "metrics.wandb_mode"}


def _bad_word(hint) -> tuple[str, str, str]:
    """A word just off the last of the field's words, that word (the closest), and the error's list."""
    words = _words(hint)
    word = [w for w in words if w][-1]
    return word + "s", word, ", ".join(w or "''" for w in words)


@pytest.mark.parametrize("key, hint", WORD_FIELDS, ids=[key for key, _ in WORD_FIELDS])
def test_a_recipe_word_outside_its_set_is_refused_naming_the_closest(tmp_path, key, hint):
    cfg = _valid_config(tmp_path)
    section, _, name = key.rpartition(".")
    target = getattr(cfg, section) if section else cfg
    in_tuple = typing.get_origin(hint) is tuple
    for word in _words(hint):  # every word of the set passes the rule
        setattr(target, name, (word,) if in_tuple else word)
        assert field_type_errors(cfg) == []
    bad, closest, words = _bad_word(hint)
    setattr(target, name, (bad,) if in_tuple else bad)
    expected = f"{key}{'[0]' if in_tuple else ''}={bad!r}: use one of {words}; did you mean {closest!r}?"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate_config(cfg, world_size=2)


@pytest.mark.parametrize("key, hint", WORD_FIELDS, ids=[key for key, _ in WORD_FIELDS])
def test_a_set_word_outside_its_set_is_refused_naming_the_closest(key, hint):
    cfg = MoltConfig()
    for word in _words(hint):
        apply_override(cfg, f"{key}={word}")
    bad, closest, words = _bad_word(hint)
    in_tuple = typing.get_origin(hint) is tuple
    expected = f"--set {key}{'[0]' if in_tuple else ''}={bad!r}: use one of {words}; did you mean {closest!r}?"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        apply_override(cfg, f"{key}={bad}")


def test_a_tuple_of_words_names_the_bad_item():
    with pytest.raises(ConfigError, match=re.escape("--set train.no_weight_decay_on[1]='bias': use one of norms, "
                                                    "biases, embeddings; did you mean 'biases'?")):
        apply_override(MoltConfig(), "train.no_weight_decay_on=norms,bias")
