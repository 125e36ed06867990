"""ChatAgentRunner: agents that drive the real OpenAI/Anthropic SDKs become experiences."""

from openai import AsyncOpenAI, BadRequestError

from molt.agents import ChatAgent, ChatAgentRunner, Result, RolloutRequest, SamplingParams
from molt.agents.env import run_with_timeout


def _request(rollout_id=0) -> RolloutRequest:
    return RolloutRequest(rollout_id=rollout_id, group_id=3, sample_index=0,
                          messages=[{"role": "user", "content": "3+5="}], label="8", tools=None,
                          sampling=SamplingParams(max_tokens=6), max_length=256, max_turns=1, policy_version=0)


def _run(engine, endpoint, agent_class, request=None):
    runner = ChatAgentRunner(agent_class)
    runner.endpoint = endpoint.endpoint
    return engine.run(run_with_timeout(runner, request or _request(), engine.engine, engine.engine.tokenizer, 60))


class ThreeTurnAgent(ChatAgent):
    replies: list[str] = []

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        for turn in range(3):
            response = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=6)
            content = response.choices[0].message.content or ""
            ThreeTurnAgent.replies.append(content)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"turn {turn}"}]
        return Result(reward=0.75, info={"turns": 3})


class CompactingAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        first = await client.chat.completions.create(model=ctx.model_name, messages=list(ctx.messages), max_tokens=6)
        summary = f"Earlier I answered {first.choices[0].message.content!r}. Again: 3+5="
        await client.chat.completions.create(model=ctx.model_name, messages=[{"role": "user", "content": summary}],
                                             max_tokens=6)
        return Result(reward=1.0, score=2.0)


def test_a_three_turn_agent_is_one_experience_of_its_replies(engine, endpoint):
    ThreeTurnAgent.replies = []
    outcome = _run(engine, endpoint, ThreeTurnAgent)
    assert outcome.failure == "", outcome.error
    (experience,) = outcome.experiences
    assert experience.reward == 0.75 and experience.group_id == 3 and experience.info == {"turns": 3.0}
    assert outcome.ledger == {"first_turn": 1, "continued": 2}
    tokenizer = engine.engine.tokenizer
    runs, current = [], []
    for token, is_action in zip(experience.token_ids, experience.action_mask):
        if is_action:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    runs += [current] if current else []
    assert [tokenizer.decode(run, skip_special_tokens=True) for run in runs] == ThreeTurnAgent.replies
    assert all(lp < 0 for lp, a in zip(experience.behavior_logprobs, experience.action_mask) if a)


def test_compaction_gives_two_experiences_sharing_the_reward(engine, endpoint):
    outcome = _run(engine, endpoint, CompactingAgent)
    assert outcome.failure == "", outcome.error
    assert [e.segment_index for e in outcome.experiences] == [0, 1]
    assert {(e.reward, e.score, e.rollout_id, e.group_id) for e in outcome.experiences} == {(1.0, 2.0, 0, 3)}
    assert outcome.ledger == {"first_turn": 1, "history_rewrite": 1}
    second = engine.engine.tokenizer.decode(outcome.experiences[1].token_ids)
    assert "Earlier I answered" in second and "Earlier I answered" not in engine.engine.tokenizer.decode(
        outcome.experiences[0].token_ids)


def test_sessions_are_closed_after_the_rollout(engine, endpoint):
    before = set(endpoint.endpoint.sessions)
    _run(engine, endpoint, CompactingAgent)
    assert set(endpoint.endpoint.sessions) == before


class OutgrowingAgent(ChatAgent):
    """Talks until the conversation no longer fits; `catch` decides whether it handles the error."""

    catch = False

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        try:
            for turn in range(50):
                response = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=6)
                messages += [{"role": "assistant", "content": response.choices[0].message.content or ""},
                             {"role": "user", "content": f"tell me more, turn {turn} " * 3}]
        except BadRequestError as error:
            assert error.code == "context_length_exceeded", error
            if not OutgrowingAgent.catch:
                raise
        return Result(reward=0.5)


def _short_request() -> RolloutRequest:
    request = _request()
    request.max_length = 96
    return request


def test_an_exhausted_context_keeps_the_captured_turns_as_truncated(engine, endpoint):
    for catch, reward in ((True, 0.5), (False, -1.0)):
        OutgrowingAgent.catch = catch
        runner = ChatAgentRunner(OutgrowingAgent)
        runner.endpoint, runner.context_exhausted_reward = endpoint.endpoint, -1.0
        outcome = engine.run(run_with_timeout(runner, _short_request(), engine.engine, engine.engine.tokenizer, 60))
        assert outcome.failure == "", outcome.error
        (experience,) = outcome.experiences
        assert experience.truncated and experience.reward == reward
        assert outcome.ledger["continued"] >= 1 and sum(experience.action_mask) > 0


def test_an_exhausted_context_fails_the_rollout_when_asked(engine, endpoint):
    OutgrowingAgent.catch = True
    runner = ChatAgentRunner(OutgrowingAgent)
    runner.endpoint, runner.on_context_exhausted = endpoint.endpoint, "fail"
    outcome = engine.run(run_with_timeout(runner, _short_request(), engine.engine, engine.engine.tokenizer, 60))
    assert outcome.failure == "context_exhausted" and "rollout.max_length=96" in outcome.error


class SeededAgent(ChatAgent):
    replies: list[list[int]] = []

    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model_name, messages=list(ctx.messages), max_tokens=12,
                                             seed=1234)
        return Result(reward=0.0)


def test_a_request_seed_does_not_make_a_groups_samples_identical(engine, endpoint):
    outcomes = [_run(engine, endpoint, SeededAgent, _request(rollout_id=index)) for index in range(4)]
    samples = {tuple(t for t, a in zip(o.experiences[0].token_ids, o.experiences[0].action_mask) if a)
               for o in outcomes}
    assert len(samples) > 1


class TemperatureAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model_name, messages=list(ctx.messages), max_tokens=6,
                                             temperature=0.7)
        return Result(reward=0.0)


def test_an_agents_own_temperature_reaches_the_experience(engine, endpoint):
    (experience,) = _run(engine, endpoint, TemperatureAgent).experiences
    assert [t for t, a in zip(experience.temperatures, experience.action_mask) if a] == \
        [0.7] * sum(experience.action_mask)
    (default,) = _run(engine, endpoint, CompactingAgent).experiences[:1]
    assert default.temperatures is None  # sampled at rollout.temperature: nothing extra to ship


def test_a_prompt_that_does_not_fit_fails_as_prompt_too_long(engine, endpoint):
    request = _request()
    request.max_length = 8
    outcome = _run(engine, endpoint, TemperatureAgent, request)
    assert outcome.failure == "prompt_too_long" and "rollout.max_length=8" in outcome.error
