"""Routed experts through everything a trace goes through (DESIGN section 5, issue 16): segments
merge each generation's routes (first recorded wins, a prefix-cache hit's unknown positions are
filled), the Env runner and a chat session record them, msgpack carries them between processes,
splits cut them, the payload store ships them, and micro-batches lay them out for the model.

The engine side (route capture) is not needed here: each test builds the routes an engine
would report by hand, with values that say which request computed which position."""

import asyncio
import dataclasses

import msgpack
import pytest
import torch

from molt.agents import Env, Result, RolloutRequest, SamplingParams, StepEnvRunner
from molt.agents.chat import build_experiences
from molt.trace.experience import Experience, Segment, split_at_version_changes
from molt.trace.generation import Generation
from molt.trace.routes import UNKNOWN, count_known
from molt.trainer.batch import build_micro_batches, count_micro_batches
from molt.transport.dispatch import decode_generation, encode_generation
from molt.transport.payloads import PayloadClient, PayloadRef, PayloadStore, offload_record, reload_record
from molt.transport.payloads.fields import payload_nbytes
from molt.transport.payloads.reference import ALIGNMENT

LAYERS, TOP_K = 2, 2  # the tiny MoE preset's


def computed_routes(request: int, num_tokens: int, *, cached: int = 0) -> torch.Tensor:
    """[num_tokens, LAYERS, TOP_K] the routes request number `request` reports: position p at
    layer l, slot k is request * 1000 + p * 4 + l * 2 + k, so every value names who computed it;
    -1 on the first `cached` positions (a prefix-cache hit) and the last (never run)."""
    p = torch.arange(num_tokens)[:, None, None]
    layer, slot = torch.arange(LAYERS)[None, :, None], torch.arange(TOP_K)[None, None, :]
    routes = (request * 1000 + p * 4 + layer * 2 + slot).to(torch.int16)
    routes[:cached] = UNKNOWN
    routes[-1:] = UNKNOWN
    return routes


def expected_routes(num_tokens: int, requests: list[tuple[int, int, int]]) -> torch.Tensor:
    """Naive first-wins: `requests` in order as (request, positions it covered, cached); each
    position keeps the first request that computed it."""
    result = torch.full((num_tokens, LAYERS, TOP_K), UNKNOWN, dtype=torch.int16)
    for request, covered, cached in requests:
        routes = computed_routes(request, covered, cached=cached)
        for position in range(covered):
            if result[position, 0, 0] == UNKNOWN:
                result[position] = routes[position]
    return result


def experience_with_routes(num_tokens: int, *, seed: int, routed: bool = True, layers: int = LAYERS,
                           top_k: int = TOP_K) -> Experience:
    generator = torch.Generator().manual_seed(seed)
    prompt = max(1, num_tokens // 3)
    action = [0] * prompt + [1] * (num_tokens - prompt)
    routes = torch.randint(-1, 64, (num_tokens, layers, top_k), dtype=torch.int16, generator=generator)
    return Experience(token_ids=torch.randint(1, 63, (num_tokens,), generator=generator).tolist(), action_mask=action,
                      behavior_logprobs=[-0.5 * a for a in action], policy_versions=[0 if a else -1 for a in action],
                      routed_experts=routes if routed else None, reward=1.0, score=1.0, group_id=seed // 4,
                      rollout_id=seed)


def msgpacked(data: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(data, use_bin_type=True), raw=False)


# -- segments: the merge rules -------------------------------------------------------------------


def test_a_continuation_keeps_the_first_routes_and_fills_what_the_cache_skipped():
    """Turn 1 computes prompt and reply (all but its last token). Turn 2 reruns the whole segment
    with a prefix-cache hit on turn 1's prompt: turn 1's routes stay where it had them, turn 2's
    fill turn 1's last token and everything new; context after turn 2 is unknown."""
    segment = Segment()
    segment.add_context([1, 2, 3, 4])
    segment.add_action([5, 6, 7], [-0.1] * 3, 0, routes=computed_routes(1, 7))
    segment.add_context([8, 9])
    segment.add_action([10, 11], [-0.2] * 2, 1, routes=computed_routes(2, 11, cached=4))
    segment.add_context([12])
    routes = segment.routes_or_none()
    assert routes.dtype == torch.int16 and routes.shape == (12, LAYERS, TOP_K)
    assert torch.equal(routes, expected_routes(12, [(1, 7, 0), (2, 11, 4)]))
    assert torch.equal(routes[:6], computed_routes(1, 7)[:6])  # turn 1's own, though turn 2 recomputed 4 and 5
    assert torch.equal(routes[6:10], computed_routes(2, 11)[6:10])  # turn 1's last token, filled by turn 2
    assert (routes[10:] == UNKNOWN).all()  # turn 2's last token and the context after it
    assert count_known(routes) == 10


def test_a_segment_without_routes_stays_without_and_wrong_lengths_are_refused():
    segment = Segment()
    segment.add_context([1, 2])
    segment.add_action([3], [-0.1], 0)
    assert segment.routes is None and segment.routes_or_none() is None
    with pytest.raises(RuntimeError, match="routes for 3 positions.*4 tokens"):
        segment.add_action([4], [-0.1], 0, routes=computed_routes(1, 3))
    with pytest.raises(ValueError, match="routed_experts has 3 positions for 4 tokens"):
        Experience(token_ids=[1, 2, 3, 4], action_mask=[0, 0, 1, 1], behavior_logprobs=[0.0] * 4,
                   policy_versions=[-1, -1, 0, 0], routed_experts=computed_routes(1, 3), reward=0.0, score=0.0,
                   group_id=0, rollout_id=0)


# -- msgpack between processes ---------------------------------------------------------------------


def test_segments_experiences_and_generations_cross_msgpack_with_their_routes():
    segment = Segment()
    segment.add_context([1, 2])
    segment.add_action([3, 4], [-0.5, -0.25], 3, temperature=0.7, routes=computed_routes(1, 4))
    segment.add_context([5])
    shipped = Segment.from_dict(msgpacked(segment.to_dict()))
    assert shipped == segment and torch.equal(shipped.routes, segment.routes) and shipped.routes.dtype == torch.int16
    assert Segment.from_dict(msgpacked(Segment(token_ids=[1]).to_dict())).routes is None

    (experience,) = build_experiences([segment], Result(reward=1.0), RolloutRequest(
        rollout_id=3, group_id=1, sample_index=0, messages=[], label="", tools=None,
        sampling=SamplingParams(max_tokens=4), max_length=64, max_turns=1, policy_version=3))
    assert torch.equal(experience.routed_experts, segment.routes_or_none())
    back = Experience.from_dict(msgpacked(experience.to_dict()))
    assert back == experience and torch.equal(back.routed_experts, experience.routed_experts)
    assert back.num_routed_tokens == experience.num_routed_tokens == 3
    plain = dataclasses.replace(experience, routed_experts=None)
    assert Experience.from_dict(msgpacked(plain.to_dict())).routed_experts is None

    generation = Generation(token_ids=[3, 4], logprobs=[-0.5, -0.25], policy_versions=[3, 3], finish_reason="stop",
                            routed_experts=computed_routes(1, 4))
    received = decode_generation(msgpacked(encode_generation(generation)))
    dense = dataclasses.replace(generation, routed_experts=None)
    assert dataclasses.replace(received, routed_experts=None) == dense
    assert torch.equal(received.routed_experts, generation.routed_experts)
    assert decode_generation(msgpacked(encode_generation(dense))) == dense


def test_splitting_at_version_changes_cuts_the_routes_with_the_tokens():
    segment = Segment()
    segment.add_context([1, 2])
    segment.add_action([3, 4], [-0.5, -0.25], 3, routes=computed_routes(1, 4))
    segment.add_context([5])
    segment.add_action([6, 7], [-0.1, -0.2], 4, routes=computed_routes(2, 7, cached=3))
    experience = Experience(token_ids=segment.token_ids, action_mask=segment.action_mask,
                            behavior_logprobs=segment.logprobs, policy_versions=segment.versions,
                            routed_experts=segment.routes_or_none(), reward=1.0, score=1.0, group_id=0, rollout_id=0)
    first, second = split_at_version_changes(experience)
    assert first.num_tokens == 4 and torch.equal(first.routed_experts, experience.routed_experts[:4])
    assert torch.equal(second.routed_experts, experience.routed_experts)
    assert torch.equal(second.routed_experts, expected_routes(7, [(1, 4, 0), (2, 7, 3)]))
    (whole,) = split_at_version_changes(dataclasses.replace(experience, routed_experts=None,
                                                            policy_versions=[-1, -1, 3, 3, -1, 3, 3]))
    assert whole.routed_experts is None


# -- the Env runner and a chat session ----------------------------------------------------------


class RoutingSampler:
    """Stands in for the engine's generate (capture is the engine's business, tested with it):
    samples two fixed tokens and reports routes for the prompt and them, request r's values,
    with a prefix-cache hit on the first `cached[r]` positions."""

    def __init__(self, cached: list[int]):
        self.cached = cached
        self.prompts: list[int] = []

    async def generate(self, token_ids, sampling):
        self.prompts.append(len(token_ids))
        request = len(self.prompts)
        covered = len(token_ids) + 2
        return Generation(token_ids=[40, 41], logprobs=[-0.5, -0.5], policy_versions=[0, 0], finish_reason="stop",
                          routed_experts=computed_routes(request, covered, cached=self.cached[request - 1]))


class ThreeTurnEnv(Env):
    async def step(self, state):
        return Result(reward=1.0, terminated=state.turn == 2, observation="again")


def test_the_env_runner_records_every_turns_routes_first_wins(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampler = RoutingSampler(cached=[0, 5, 0])
    request = RolloutRequest(rollout_id=0, group_id=0, sample_index=0, messages=[{"role": "user", "content": "3+5="}],
                             label="8", tools=None, sampling=SamplingParams(max_tokens=2), max_length=256,
                             max_turns=3, policy_version=0)
    outcome = asyncio.run(StepEnvRunner(ThreeTurnEnv).run(request, sampler, tokenizer))
    (experience,) = outcome.experiences
    covered = [prompt + 2 for prompt in sampler.prompts]
    assert covered[-1] == experience.num_tokens
    want = expected_routes(experience.num_tokens, [(r + 1, n, c) for r, (n, c) in enumerate(zip(covered, [0, 5, 0]))])
    assert torch.equal(experience.routed_experts, want)
    assert experience.num_routed_tokens == experience.num_tokens - 1  # all but the last sampled token


class RoutingEngine:
    """The scripted engine (tests/scripted_engine.py) plus, on its last delta, the routes request r
    reports (`computed_routes`), with a prefix-cache hit on the first `cached[r]` positions."""

    def __init__(self, scripted, cached: list[int]):
        self.scripted, self.cached = scripted, cached
        self.covered: list[int] = []

    async def stream(self, token_ids, sampling, **kwargs):
        deltas = [delta async for delta in self.scripted.stream(token_ids, sampling, **kwargs)]
        covered = len(token_ids) + sum(len(d.token_ids) for d in deltas)
        self.covered.append(covered)
        request = len(self.covered)
        deltas[-1].routed_experts = computed_routes(request, covered, cached=self.cached[request - 1])
        for delta in deltas:
            yield delta


def test_a_chat_session_keeps_each_turns_routes_in_its_segment(tiny_model_dir):
    """Two turns continue one segment (the second a prefix-cache hit on the first prompt), then a
    rewritten history opens a new segment with only its own request's routes."""
    from transformers import AutoTokenizer

    from molt.endpoint.messages import ChatRequest, Sampling, normalize_messages
    from molt.endpoint.session import Session
    from molt.endpoint.template_check import turn_end_text
    from scripted_engine import Script, ScriptedEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    scripted = ScriptedEngine(tokenizer)
    scripted.play(Script(chunks=["Hello", " there"]), Script(chunks=["Sure"]), Script(chunks=["Fresh"]))
    engine = RoutingEngine(scripted, cached=[0, 6, 0])
    session = Session(session_id="s", api_key="k", model_name="m", engine=engine, tokenizer=tokenizer,
                      sampling=SamplingParams(max_tokens=16), max_length=512, base_url="http://127.0.0.1:1/s/s",
                      turn_end=turn_end_text(tokenizer))

    def ask(messages):
        chat = ChatRequest(messages=normalize_messages(messages), tools=None, sampling=Sampling())
        return asyncio.run(session.complete(chat))

    first = [{"role": "user", "content": "hi"}]
    reply = ask(first)
    second = first + [{"role": "assistant", "content": reply.parts[0]}, {"role": "user", "content": "more"}]
    ask(second)
    (segment,) = session.all_segments()
    assert len(segment.routes) == len(segment.token_ids) == engine.covered[1]
    assert torch.equal(segment.routes, expected_routes(engine.covered[1], [(1, engine.covered[0], 0),
                                                                          (2, engine.covered[1], 6)]))
    ask([{"role": "user", "content": "something else"}])
    closed, fresh = session.all_segments()
    assert closed is segment
    assert torch.equal(fresh.routes, computed_routes(3, engine.covered[2]))


# -- the payload store ------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    import secrets

    node = f"test{secrets.token_hex(4)}"
    with PayloadStore(node, budget_bytes=256 << 10, spill_dir=str(tmp_path / "spill")) as store:
        yield store


@pytest.mark.parametrize("path", ["inline", "shm", "spilled", "remote"])
def test_routes_travel_in_the_payload_and_come_back_on_reload(store, tmp_path, path):
    """payload_nbytes counts the routes (so a routed experience goes inline only when they fit
    too), the record or the payload carries them, and reload gives them back bit for bit."""
    num_tokens = {"inline": 64, "shm": 4096, "spilled": 24_000, "remote": 4096}[path]
    experience = experience_with_routes(num_tokens, seed=num_tokens)
    plain = dataclasses.replace(experience, routed_experts=None)
    aligned = -(-num_tokens * LAYERS * TOP_K * 2 // ALIGNMENT) * ALIGNMENT
    assert payload_nbytes(experience) == payload_nbytes(plain) + aligned
    if path == "spilled":
        store.offload({"filler": torch.zeros(200 << 10, dtype=torch.uint8)})  # most of the budget
    record = offload_record(store, experience)
    if path == "inline":
        assert record.payload is None
    else:
        ref = PayloadRef.from_dict(record.payload)
        assert ref.location == ("file" if path == "spilled" else "shm")
        assert ref.entry("routed_experts").dtype == "int16" and ref.entry("routed_experts").shape == (
            num_tokens, LAYERS, TOP_K)
        assert record.routed_experts is None and record.num_routed_tokens == count_known(experience.routed_experts)
        assert payload_nbytes(experience) == sum(-(-e.nbytes // ALIGNMENT) * ALIGNMENT for e in ref.entries)
    shipped = Experience.from_dict(msgpacked(record.to_dict()))
    client = PayloadClient("elsewhere") if path == "remote" else PayloadClient(store.node_id, store=store)
    try:
        full = reload_record(client, shipped)
    finally:
        client.close()
    assert full.token_ids == experience.token_ids and full.routed_experts.dtype == torch.int16
    assert torch.equal(full.routed_experts, experience.routed_experts)


def test_routes_count_against_the_inline_threshold(store):
    """The largest plain experience that goes inline goes to the store once it carries routes."""
    num_tokens = max(n for n in range(1, 4096)
                     if payload_nbytes(experience_with_routes(n, seed=0, routed=False)) <= store.inline_bytes)
    plain = experience_with_routes(num_tokens, seed=1, routed=False)
    assert offload_record(store, plain).payload is None
    routed = experience_with_routes(num_tokens, seed=1)
    record = offload_record(store, routed)
    assert record.payload is not None
    client = PayloadClient(store.node_id, store=store)
    try:
        assert torch.equal(reload_record(client, record).routed_experts, routed.routed_experts)
    finally:
        client.close()


# -- micro-batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["padded", "rows", "row"])
def test_micro_batches_lay_routes_out_like_the_model_inputs(layout):
    """Each row holds its experience's routes, -1 on padding and for experiences without; the
    model's layout, checked against a naive walk over the packed positions, has -1 on pad tails."""
    experiences = [experience_with_routes(n, seed=n, routed=n % 3 != 0) for n in (5, 9, 12, 3, 7, 6, 15, 4, 18)]
    budget = 30
    micro_batches = build_micro_batches(experiences, max_tokens_per_micro_batch=budget, pad_token_id=0, layout=layout,
                                        num_micro_batches=count_micro_batches(
                                            experiences, max_tokens_per_micro_batch=budget, layout=layout) + 1)
    seen, mixed = set(), False
    for micro_batch in micro_batches:
        if micro_batch.rows == [-1]:  # the filler
            assert micro_batch.routed_experts is None and micro_batch.model_routed_experts() is None
            continue
        routes = micro_batch.routed_experts
        if all(experiences[index].routed_experts is None for index in micro_batch.rows):
            assert routes is None and micro_batch.model_routed_experts() is None
            seen.update(micro_batch.rows)
            continue
        assert routes.dtype == torch.int16 and routes.shape == (*micro_batch.input_ids.shape, LAYERS, TOP_K)
        for row, index in enumerate(micro_batch.rows):
            seen.add(index)
            experience, n = experiences[index], experiences[index].num_tokens
            if experience.routed_experts is None:
                assert (routes[row] == UNKNOWN).all()
                mixed = True
            else:
                assert torch.equal(routes[row, :n], experience.routed_experts)
                assert (routes[row, n:] == UNKNOWN).all()
        in_model = micro_batch.model_routed_experts()
        ids = micro_batch.model_inputs()["input_ids"]
        assert in_model.shape == (*ids.shape, LAYERS, TOP_K)
        if layout == "padded":
            assert in_model is routes
            continue
        width = ids.shape[1]
        for position, source in enumerate(micro_batch.packed_index.tolist()):  # naive: position by position
            packed_row, column = divmod(position, width)
            if source < 0:
                assert (in_model[packed_row, column] == UNKNOWN).all()
            else:
                row, offset = divmod(source, micro_batch.input_ids.shape[1])
                assert torch.equal(in_model[packed_row, column], routes[row, offset])
    assert seen == set(range(len(experiences)))
    assert mixed  # some micro-batch holds experiences with and without routes
    routed = next(micro_batch for micro_batch in micro_batches if micro_batch.routed_experts is not None)
    assert torch.equal(routed.to(torch.device("cpu")).routed_experts, routed.routed_experts)


def test_micro_batches_without_routes_have_none_and_mixed_models_are_refused():
    plain = [experience_with_routes(n, seed=n, routed=False) for n in (4, 6)]
    (micro_batch,) = build_micro_batches(plain, max_tokens_per_micro_batch=64, pad_token_id=0, layout="rows")
    assert micro_batch.routed_experts is None and micro_batch.model_routed_experts() is None
    mixed = [experience_with_routes(4, seed=1), experience_with_routes(6, seed=2, layers=3)]
    with pytest.raises(ValueError, match=r"different \[layers, top_k\]: \[\(2, 2\), \(3, 2\)\]"):
        build_micro_batches(mixed, max_tokens_per_micro_batch=64, pad_token_id=0)


# -- end to end: the real MoE engine behind the session endpoint --------------------------------------


@pytest.mark.e2e
def test_a_two_turn_conversation_on_the_moe_engine_has_routes_for_both_turns(moe_engine):
    """Through the HTTP endpoint with the OpenAI SDK: after turn 1 the segment has a route at every
    position but its last sampled token; turn 2 continues the segment, keeps turn 1's routes, fills
    that last token, and covers its own context and reply; the experience carries them through
    msgpack."""
    from openai import OpenAI

    from conftest import EndpointThread

    endpoint = EndpointThread(moe_engine)
    try:
        session = endpoint.open_session(max_tokens=6)
        client = OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "3+5="}]
        reply = client.chat.completions.create(model=session.model_name, messages=messages)
        (segment,) = session.all_segments()
        first, num_first = segment.routes.clone(), len(segment.token_ids)
        assert first.shape == (num_first, LAYERS, TOP_K) and first.dtype == torch.int16
        assert (first[:-1] >= 0).all() and (first[-1] == UNKNOWN).all()

        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": "and 2+2?"}]
        client.chat.completions.create(model=session.model_name, messages=messages)
        assert session.ledger.counts["continued"] == 1
        (segment,) = session.all_segments()
        routes = segment.routes
        assert len(routes) == len(segment.token_ids) > num_first
        assert torch.equal(routes[:num_first - 1], first[:-1])  # turn 1's, kept
        assert (routes[:-1] >= 0).all() and (routes[-1] == UNKNOWN).all()  # both turns' tokens, all computed
        record = moe_engine.run(endpoint.endpoint.end_session(session))
        (experience,) = build_experiences(record.segments, Result(reward=1.0), RolloutRequest(
            rollout_id=0, group_id=0, sample_index=0, messages=messages, label="", tools=None,
            sampling=SamplingParams(max_tokens=6), max_length=256, max_turns=2, policy_version=0))
        shipped = Experience.from_dict(msgpacked(experience.to_dict()))
        assert torch.equal(shipped.routed_experts, routes) and shipped.num_routed_tokens == len(routes) - 1
    finally:
        moe_engine.run(endpoint.endpoint.stop())
