"""The trainer's optimizer: LR schedules against hand-computed values, their state across a resume,
and the parameters exempt from weight decay."""

import math

import pytest
import torch
import transformers

from molt.trainer.optimizer import OptimizerSettings, build_optimizer, group_parameters, lr_factor


def settings(schedule: str, **fields) -> OptimizerSettings:
    return OptimizerSettings(lr=1e-3, schedule=schedule, **fields)


@pytest.mark.parametrize("schedule, expected", [
    # 10 steps, 2 of warmup, floor 0.1: steps 1-2 ramp (1/2, 2/2); steps 3..10 have progress
    # (s - 1 - 2) / 8 = 0, 1/8, ..., 7/8.
    ("constant", [0.5, 1.0] + [1.0] * 8),
    ("linear", [0.5, 1.0] + [0.1 + 0.9 * (1 - k / 8) for k in range(8)]),
    ("cosine", [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]),
])
def test_lr_factor_matches_hand_computed_values(schedule, expected):
    got = [lr_factor(step, settings(schedule, num_steps=10, warmup_steps=2, min_lr_ratio=0.1)) for step in range(1, 11)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_lr_factor_spot_values():
    cosine = settings("cosine", num_steps=5, warmup_steps=0, min_lr_ratio=0.0)
    # Written out: progress 0, .2, .4, .6, .8 -> (1 + cos(pi p)) / 2.
    assert [round(lr_factor(s, cosine), 6) for s in range(1, 6)] == [1.0, 0.904508, 0.654508, 0.345492, 0.095492]
    linear = settings("linear", num_steps=4, warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_factor(s, linear) for s in range(1, 5)] == [1.0, 0.75, 0.5, 0.25]
    assert lr_factor(1, settings("constant", num_steps=3, warmup_steps=3)) == pytest.approx(1 / 3)


def advance(optimizer, scheduler, steps: int) -> list[float]:
    """The learning rate each training step runs at (the scheduler advances after each)."""
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_schedule_drives_adamw_and_resumes_from_its_state():
    spec = settings("cosine", num_steps=8, warmup_steps=2, min_lr_ratio=0.2)
    expected = [1e-3 * lr_factor(step, spec) for step in range(1, 9)]

    model = torch.nn.Linear(4, 4)
    optimizer, scheduler = build_optimizer(model, spec)
    assert advance(optimizer, scheduler, 8) == pytest.approx(expected, rel=1e-12)

    # Three steps, save the schedule's state, a fresh optimizer loads it and runs the other five.
    optimizer, scheduler = build_optimizer(torch.nn.Linear(4, 4), spec)
    first = advance(optimizer, scheduler, 3)
    state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    resumed_optimizer, resumed = build_optimizer(torch.nn.Linear(4, 4), spec)
    resumed.load_state_dict({**resumed.state_dict(), **state})
    for group, lr in zip(resumed_optimizer.param_groups, resumed.get_last_lr()):
        group["lr"] = lr
    assert first + advance(resumed_optimizer, resumed, 5) == pytest.approx(expected, rel=1e-12)


def tiny_qwen3(bias: bool = False):
    config = transformers.Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=50,
                                      tie_word_embeddings=True, attention_bias=bias)
    return transformers.Qwen3ForCausalLM(config)


def split_weight_decay(model, exempt):
    groups = group_parameters(model, OptimizerSettings(lr=1.0, weight_decay=0.1, no_weight_decay_on=exempt))
    return ([p for g in groups if g["weight_decay"] for p in g["params"]],
            [p for g in groups if not g["weight_decay"] for p in g["params"]])


def test_no_weight_decay_groups_pick_norms_biases_and_embeddings():
    model = tiny_qwen3(bias=True)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, exempt = split_weight_decay(model, ("norms", "biases", "embeddings"))
    exempt_names = {names[id(p)] for p in exempt}
    assert "model.embed_tokens.weight" in exempt_names  # and the tied LM head with it (one parameter)
    assert "model.layers.0.input_layernorm.weight" in exempt_names and "model.norm.weight" in exempt_names
    assert "model.layers.0.self_attn.q_norm.weight" in exempt_names
    assert "model.layers.1.self_attn.q_proj.bias" in exempt_names
    assert {names[id(p)] for p in decayed} == {n for n in names.values() if n.endswith("proj.weight")}
    assert len(decayed) + len(exempt) == len(list(model.parameters()))

    decayed, exempt = split_weight_decay(model, ("biases",))
    assert {names[id(p)] for p in exempt} == {n for n in names.values() if n.endswith(".bias")}

    optimizer, _ = build_optimizer(model, OptimizerSettings(lr=1e-3, weight_decay=0.1, no_weight_decay_on=("norms",)))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    optimizer, _ = build_optimizer(model, OptimizerSettings(lr=1e-3, weight_decay=0.1))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1]  # the default: one group, as before


def test_exempt_parameters_keep_their_values_under_pure_weight_decay():
    """With zero gradients AdamW's update is the decay alone: exempt parameters do not move."""
    model = tiny_qwen3()
    optimizer, _ = build_optimizer(model, OptimizerSettings(lr=0.1, weight_decay=0.5, no_weight_decay_on=("norms",)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in model.named_parameters():
        moved = not torch.equal(parameter, before[name])
        assert moved == ("norm" not in name), name


def test_lr_multipliers_give_modules_their_own_rate_under_the_shared_schedule():
    model = tiny_qwen3(bias=True)
    settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, no_weight_decay_on=("biases",), schedule="linear",
                                 num_steps=4, lr_multipliers=(("model.layers.1.", 3.0), ("model.layers.1.mlp.", 0.5)))
    optimizer, schedule = build_optimizer(model, settings)
    names = {id(p): n for n, p in model.named_parameters()}
    rate = {names[id(p)]: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    assert rate["model.layers.0.self_attn.q_proj.weight"] == (1e-3, 0.1)
    assert rate["model.layers.1.self_attn.q_proj.weight"] == (pytest.approx(3e-3), 0.1)
    assert rate["model.layers.1.self_attn.q_proj.bias"] == (pytest.approx(3e-3), 0.0)
    assert rate["model.layers.1.mlp.up_proj.weight"] == (pytest.approx(5e-4), 0.1)  # the longest prefix wins
    assert len(rate) == len(list(model.parameters())) and optimizer.param_groups[0]["lr"] == 1e-3
    schedule.step()
    assert {round(g["lr"] / g["initial_lr"], 12) for g in optimizer.param_groups} == {0.75}  # one schedule
    with pytest.raises(ValueError, match="no trainable parameter name starts with \\['vision.'\\]"):
        build_optimizer(model, OptimizerSettings(lr=1e-3, lr_multipliers=(("vision.", 2.0),)))
