"""Segments and experiences carry the temperature each token was sampled at: recorded per turn,
shipped only when some action token differs from the run's, and kept through msgpack and splits."""

import msgpack
import pytest

from molt.trace.experience import Experience, Segment, split_at_version_changes


def two_turn_segment() -> Segment:
    """Prompt, a turn sampled at 0.7, a tool result, a turn sampled at 1.0."""
    segment = Segment()
    segment.add_context([1, 2, 3])
    segment.add_action([4, 5], [-0.5, -1.0], 3, temperature=0.7)
    segment.add_context([6])
    segment.add_action([7, 8, 9], [-0.25, -2.0, -0.75], [3, 4, 4], temperature=1.0)
    return segment


def experience_of(segment: Segment, temperatures: list[float] | None) -> Experience:
    return Experience(token_ids=segment.token_ids, action_mask=segment.action_mask, behavior_logprobs=segment.logprobs,
                      policy_versions=segment.versions, temperatures=temperatures, reward=1.0, score=1.0, group_id=0,
                      rollout_id=5)


def test_segments_record_a_temperature_per_token():
    segment = two_turn_segment()
    assert segment.temperatures == [1.0, 1.0, 1.0, 0.7, 0.7, 1.0, 1.0, 1.0, 1.0]
    assert len(segment.temperatures) == len(segment.token_ids)
    copied = segment.copy()
    copied.add_action([10], [-0.1], 4, temperature=0.3)
    assert len(segment.temperatures) == 9 and copied.temperatures[-1] == 0.3
    plain = Segment()
    plain.add_action([1, 2], [-0.1, -0.2], 0)  # the keyword is optional: 1.0
    assert plain.temperatures == [1.0, 1.0]


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), float("inf")])
def test_a_segment_refuses_a_temperature_log_probs_cannot_be_recomputed_at(temperature):
    with pytest.raises(ValueError, match=f"temperature={temperature}"):
        Segment().add_action([1], [-0.1], 0, temperature=temperature)


def test_temperatures_ship_only_when_an_action_token_differs_from_the_default():
    segment = two_turn_segment()
    assert segment.action_temperatures_or_none(1.0) == segment.temperatures  # turn 1 was at 0.7
    assert segment.action_temperatures_or_none(0.7) == segment.temperatures
    same = Segment()
    same.add_context([1, 2])  # context at 1.0 does not count: it is never trained on
    same.add_action([3, 4], [-0.1, -0.2], 0, temperature=0.7)
    assert same.action_temperatures_or_none(0.7) is None


def test_temperatures_survive_msgpack_and_none_stays_none():
    segment = two_turn_segment()
    for temperatures in (segment.temperatures, None):
        experience = experience_of(segment, temperatures)
        wire = msgpack.unpackb(msgpack.packb(experience.to_dict()), raw=False)
        assert Experience.from_dict(wire) == experience
        assert Experience.from_dict(wire).temperatures == temperatures


def test_an_experience_refuses_temperatures_of_another_length():
    segment = two_turn_segment()
    with pytest.raises(ValueError, match="temperatures has 8 entries for 9 tokens"):
        experience_of(segment, segment.temperatures[:-1])


def test_splitting_at_version_changes_keeps_each_pieces_temperatures():
    segment = two_turn_segment()  # versions 3, 3 | 3, 4, 4: split after token 7
    first, second = split_at_version_changes(experience_of(segment, segment.temperatures))
    assert first.temperatures == segment.temperatures[:7] and second.temperatures == segment.temperatures
    assert [t for t, a in zip(first.temperatures, first.action_mask) if a] == [0.7, 0.7, 1.0]
    assert [t for t, a in zip(second.temperatures, second.action_mask) if a] == [1.0, 1.0]
    assert all(piece.temperatures is None for piece in split_at_version_changes(experience_of(segment, None)))
