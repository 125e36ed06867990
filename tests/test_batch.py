import dataclasses
import random

import pytest
import torch

from molt.trace.experience import Experience
from molt.trainer.batch import assign_to_ranks, build_micro_batches, count_micro_batches

PAD = 0


def make_experience(rng: random.Random, num_tokens: int, rollout_id: int) -> Experience:
    prompt = rng.randint(1, num_tokens - 1) if num_tokens > 1 else 1
    action_mask = [0] * prompt + [1] * (num_tokens - prompt)
    return Experience(
        token_ids=[rng.randint(1, 63) for _ in range(num_tokens)],
        action_mask=action_mask,
        behavior_logprobs=[-rng.random() if a else 0.0 for a in action_mask],
        policy_versions=[0 if a else -1 for a in action_mask],
        reward=rng.random(),
        score=0.0,
        group_id=rollout_id // 4,
        rollout_id=rollout_id,
    )


def make_experiences(seed: int, count: int, max_tokens: int = 200) -> list[Experience]:
    rng = random.Random(seed)
    return [make_experience(rng, rng.randint(2, max_tokens), i) for i in range(count)]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_assign_to_ranks_balances_tokens(num_ranks):
    experiences = make_experiences(seed=num_ranks, count=64)
    assignment = assign_to_ranks(experiences, num_ranks)
    assert sorted(i for indices in assignment for i in indices) == list(range(64))
    loads = [sum(experiences[i].num_tokens for i in indices) for indices in assignment]
    longest = max(e.num_tokens for e in experiences)
    # Greedy longest-first guarantee: the spread never exceeds one experience.
    assert max(loads) - min(loads) <= longest
    # On this random mix it is far tighter: within 5% of the mean load.
    mean = sum(loads) / num_ranks
    assert max(loads) - min(loads) <= 0.05 * mean


def test_assign_to_ranks_more_ranks_than_experiences():
    experiences = make_experiences(seed=0, count=2)
    assignment = assign_to_ranks(experiences, 4)
    assert sorted(len(indices) for indices in assignment) == [0, 0, 1, 1]


def test_micro_batches_respect_budget_and_keep_every_token():
    experiences = make_experiences(seed=3, count=40) + [make_experience(random.Random(9), 700, 99)]
    advantages = [float(i) - 20.0 for i in range(len(experiences))]
    budget = 512
    micro_batches = build_micro_batches(
        experiences, advantages, max_tokens_per_micro_batch=budget, pad_token_id=PAD
    )
    assert len(micro_batches) == count_micro_batches(experiences, max_tokens_per_micro_batch=budget)
    seen = []
    for micro_batch in micro_batches:
        rows, seq = micro_batch.input_ids.shape
        assert rows * seq <= budget or rows == 1, "only a lone over-long row may exceed the budget"
        for row in range(rows):
            length = int(micro_batch.attention_mask[row].sum())
            assert micro_batch.attention_mask[row, :length].all(), "right padding"
            assert (micro_batch.input_ids[row, length:] == PAD).all()
            seen.append(
                (
                    micro_batch.input_ids[row, :length].tolist(),
                    micro_batch.action_mask[row, :length].tolist(),
                    micro_batch.behavior_logprobs[row, :length].tolist(),
                    micro_batch.advantages[row, :length].tolist(),
                )
            )
            assert micro_batch.action_mask[row, length:].sum() == 0
    expected = [
        (
            e.token_ids,
            [float(a) for a in e.action_mask],
            torch.tensor(e.behavior_logprobs, dtype=torch.float32).tolist(),
            [advantage * a for a in e.action_mask],
        )
        for e, advantage in zip(experiences, advantages)
    ]
    assert sorted(seen) == sorted(expected)
    assert sum(m.num_action_tokens for m in micro_batches) == sum(e.num_action_tokens for e in experiences)


def test_micro_batches_padded_to_requested_count():
    experiences = make_experiences(seed=4, count=5, max_tokens=30)
    needed = count_micro_batches(experiences, max_tokens_per_micro_batch=64)
    micro_batches = build_micro_batches(
        experiences, [1.0] * 5, max_tokens_per_micro_batch=64, pad_token_id=PAD,
        num_micro_batches=needed + 2,
    )
    assert len(micro_batches) == needed + 2
    for filler in micro_batches[needed:]:
        assert filler.input_ids.shape == (1, 1)
        assert filler.num_action_tokens == 0
        assert filler.attention_mask.sum() == 1
    only_fillers = build_micro_batches(
        [], [], max_tokens_per_micro_batch=64, pad_token_id=PAD, num_micro_batches=2
    )
    assert [m.input_ids.shape for m in only_fillers] == [(1, 1), (1, 1)]
    with pytest.raises(ValueError, match="num_micro_batches"):
        build_micro_batches(
            experiences, [1.0] * 5, max_tokens_per_micro_batch=64, pad_token_id=PAD,
            num_micro_batches=needed - 1,
        )


def test_a_rollout_with_several_segments_counts_once_in_its_group():
    from molt.trainer.batch import compute_group_advantages

    def segment(rollout_id, group_id, reward, index=0):
        return Experience(token_ids=[1, 2], action_mask=[0, 1], behavior_logprobs=[0.0, -1.0],
                          policy_versions=[-1, 0], reward=reward, score=reward, group_id=group_id,
                          rollout_id=rollout_id, segment_index=index)

    # Group 0: rollout 0 (reward 1, three segments) and rollout 1 (reward 0, one segment).
    experiences = [segment(0, 0, 1.0, 0), segment(0, 0, 1.0, 1), segment(0, 0, 1.0, 2), segment(1, 0, 0.0),
                   segment(2, 1, 0.5), segment(3, 1, 0.5)]
    advantages = compute_group_advantages([e.rollout_id for e in experiences], [e.group_id for e in experiences],
                                          [e.reward for e in experiences], estimator="grpo")
    # Counted once: mean 0.5, unbiased std of [1, 0] = 0.7071 -> +-0.7071 (not the 3:1 weighting).
    expected = 0.5 / (2 ** -0.5 + 1e-6)
    assert advantages[:4] == pytest.approx([expected, expected, expected, -expected], rel=1e-9)
    assert advantages[4:] == [0.0, 0.0]  # a constant-reward group


@pytest.mark.parametrize("layout", ["rows", "row"])
def test_packed_layouts_respect_the_budget_and_hold_every_token_once(layout):
    """Packed rows hold each experience's tokens exactly once, back to back, with positions that
    restart per sequence; the budget bounds the positions computed; rows are as wide as the
    micro-batch's longest experience (rows) or one row (row)."""
    experiences = make_experiences(seed=4, count=60) + [make_experience(random.Random(5), 700, 99)]
    budget = 512
    micro_batches = build_micro_batches(experiences, max_tokens_per_micro_batch=budget, pad_token_id=PAD,
                                        layout=layout)
    assert len(micro_batches) == count_micro_batches(experiences, max_tokens_per_micro_batch=budget, layout=layout)
    padded = build_micro_batches(experiences, max_tokens_per_micro_batch=budget, pad_token_id=PAD)
    assert sum(m.num_model_tokens for m in micro_batches) < sum(m.num_model_tokens for m in padded)
    seen, shared_rows = [], 0
    for micro_batch in micro_batches:
        packed_rows, width = micro_batch.packed_ids.shape
        assert packed_rows * width <= budget or micro_batch.num_real_tokens > budget
        assert packed_rows == 1 if layout == "row" else width == micro_batch.input_ids.shape[1]
        index = micro_batch.packed_index.view(packed_rows, width)
        for row in range(packed_rows):
            real = index[row] >= 0
            assert real[: int(real.sum())].all(), "padding only at the row's end"
            starts = int(((micro_batch.position_ids[row] == 0) & real).sum())
            shared_rows += starts > 1
        rows = micro_batch.to_rows(micro_batch.packed_ids.float()).long()
        assert torch.equal(rows * micro_batch.attention_mask, micro_batch.input_ids * micro_batch.attention_mask)
        for row in range(len(micro_batch.rows)):
            length = int(micro_batch.attention_mask[row].sum())
            seen.append(micro_batch.input_ids[row, :length].tolist())
        assert micro_batch.num_real_tokens == int((micro_batch.packed_index >= 0).sum())
    assert shared_rows > 0
    assert sorted(seen) == sorted(e.token_ids for e in experiences)


@pytest.mark.parametrize("layout", ["padded", "rows", "row"])
def test_micro_batches_carry_each_tokens_sampling_temperature(layout):
    """Experiences with their own temperatures (turns at 0.7 and 1.0) land in `temperatures`
    token for token; those without, padding and filler micro-batches get the run's temperature;
    in the model's layout (packed or not) each real position keeps its token's value."""
    default = 0.6
    experiences = make_experiences(seed=7, count=12, max_tokens=40)
    rng = random.Random(8)
    for experience in experiences[::2]:
        experience.temperatures = [rng.choice([0.7, 1.0, 1.25]) for _ in experience.token_ids]
    micro_batches = build_micro_batches(experiences, max_tokens_per_micro_batch=80, pad_token_id=PAD, layout=layout,
                                        temperature=default, num_micro_batches=count_micro_batches(
                                            experiences, max_tokens_per_micro_batch=80, layout=layout) + 1)
    seen = set()
    for micro_batch in micro_batches:
        assert micro_batch.temperatures.dtype == torch.float32
        assert micro_batch.temperatures.shape == micro_batch.input_ids.shape
        for row, index in enumerate(micro_batch.rows):
            if index < 0:  # the filler micro-batch
                assert micro_batch.temperatures.tolist() == [[torch.tensor(default).item()]]
                continue
            seen.add(index)
            experience, n = experiences[index], experiences[index].num_tokens
            want = experience.temperatures or [default] * n
            assert micro_batch.temperatures[row, :n].tolist() == torch.tensor(want, dtype=torch.float32).tolist()
            assert (micro_batch.temperatures[row, n:] == torch.tensor(default)).all()
        in_model = micro_batch.model_temperatures()
        assert in_model.shape == micro_batch.model_inputs()["input_ids"].shape
        mask = micro_batch.attention_mask.bool()
        assert torch.equal(micro_batch.to_rows(in_model)[mask], micro_batch.temperatures[mask])
        assert (in_model > 0).all()
    assert seen == set(range(len(experiences)))


def test_an_experience_without_temperatures_costs_nothing_and_equals_the_default():
    """None means the run's temperature: the same micro-batch as one listing it for every token."""
    experiences = make_experiences(seed=9, count=5, max_tokens=30)
    listed = [dataclasses.replace(e, temperatures=[0.8] * e.num_tokens) for e in experiences]
    for layout in ("padded", "rows"):
        plain, explicit = (build_micro_batches(batch, max_tokens_per_micro_batch=64, pad_token_id=PAD, layout=layout,
                                               temperature=0.8)
                           for batch in (experiences, listed))
        for a, b in zip(plain, explicit, strict=True):
            assert torch.equal(a.temperatures, b.temperatures)
            assert torch.equal(a.model_temperatures(), b.model_temperatures())
    assert build_micro_batches(experiences, max_tokens_per_micro_batch=64, pad_token_id=PAD)[0].temperatures.eq(1).all()


def test_build_windows_passes_the_run_temperature_on():
    from molt.trainer.batch import build_windows, count_window_micro_batches

    experiences = make_experiences(seed=10, count=6, max_tokens=20)
    experiences[0].temperatures = [1.5] * experiences[0].num_tokens
    counts = count_window_micro_batches(experiences, num_windows=2, max_tokens_per_micro_batch=40, layout="rows")
    windows = build_windows(experiences, num_windows=2, micro_batch_counts=counts, max_tokens_per_micro_batch=40,
                            pad_token_id=PAD, layout="rows", temperature=0.5)
    values = {round(v, 6) for w in windows for m in w for v in m.temperatures.flatten().tolist()}
    assert values == {0.5, 1.5}
