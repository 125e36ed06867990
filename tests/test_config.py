"""Config loading, overrides and start-up validation."""

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
