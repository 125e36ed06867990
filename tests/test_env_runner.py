"""The Env path against the real vLLM engine: token-exact traces, multi-turn context, failures."""

import asyncio
import textwrap

import pytest

from molt.agents import Env, Result, RolloutRequest, SamplingParams, StepEnvRunner, load_agent_runner
from molt.agents.env import run_with_timeout


def _request(max_turns=1, max_tokens=4, max_length=128, label="8", rollout_id=0) -> RolloutRequest:
    return RolloutRequest(rollout_id=rollout_id, group_id=0, sample_index=0,
                          messages=[{"role": "user", "content": "3+5="}], label=label, tools=None,
                          sampling=SamplingParams(max_tokens=max_tokens), max_length=max_length,
                          max_turns=max_turns, policy_version=0)


class EchoEnv(Env):
    """Rewards 1 for an answer equal to the label; records what it saw."""

    seen = []

    async def step(self, state):
        EchoEnv.seen.append(state)
        return Result(reward=float(state.action_text.strip() == state.label), info={"turn": state.turn})


class TwoTurnEnv(Env):
    async def step(self, state):
        if state.turn == 0:
            return Result(reward=0.25, terminated=False, observation="Wrong. Try again.")
        return Result(reward=0.5, score=7.0)


def _run(engine, runner, request, timeout_seconds=60.0):
    return engine.run(run_with_timeout(runner, request, engine.engine, engine.engine.tokenizer, timeout_seconds))


def test_single_turn_trace_is_the_prompt_plus_the_sampled_tokens(engine):
    tokenizer = engine.engine.tokenizer
    EchoEnv.seen.clear()
    outcome = _run(engine, StepEnvRunner(EchoEnv), _request())
    assert outcome.failure == ""
    (experience,) = outcome.experiences
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3+5="}], add_generation_prompt=True,
                                           tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    n = len(prompt_ids)
    assert experience.token_ids[:n] == prompt_ids
    actions = experience.token_ids[n:]
    assert 1 <= len(actions) <= 4
    assert experience.action_mask == [0] * n + [1] * len(actions)
    assert experience.policy_versions == [-1] * n + [engine.engine.policy_version] * len(actions)
    assert all(lp == 0.0 for lp in experience.behavior_logprobs[:n])
    assert all(lp < 0.0 for lp in experience.behavior_logprobs[n:])
    (state,) = EchoEnv.seen
    assert state.observation_text == prompt
    assert state.action_text == tokenizer.decode(actions, skip_special_tokens=True)
    assert experience.reward == float(state.action_text.strip() == "8")
    assert experience.info == {"turn": 0.0}


def test_recorded_logprobs_are_the_engines_for_those_tokens(engine):
    """Re-score the recorded sequence with the engine's prompt log-probs: the sampled tokens'
    recorded log-probs must match (temperature 1, same weights)."""
    outcome = _run(engine, StepEnvRunner(EchoEnv), _request(max_tokens=8))
    (experience,) = outcome.experiences
    rescored = engine.run(engine.engine.score(experience.token_ids))
    for logprob, again, is_action in zip(experience.behavior_logprobs, rescored, experience.action_mask):
        if is_action:
            assert abs(logprob - again) < 1e-4


def test_multi_turn_appends_the_observation_as_the_template_renders_it(engine):
    tokenizer = engine.engine.tokenizer
    outcome = _run(engine, StepEnvRunner(TwoTurnEnv), _request(max_turns=2))
    (experience,) = outcome.experiences
    mask = experience.action_mask
    spans = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    assert len(spans) == 3 or (len(spans) == 2 and mask[-1] == 1)  # prompt | act | context | act
    first_action = experience.token_ids[spans[0]:spans[1]]
    messages = [{"role": "user", "content": "3+5="},
                {"role": "assistant", "content": tokenizer.decode(first_action, skip_special_tokens=True)},
                {"role": "user", "content": "Wrong. Try again."}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    second_start = spans[2]
    if first_action[-1] == tokenizer.eos_token_id:  # a complete first turn: the history is exactly the template's
        assert tokenizer.decode(experience.token_ids[:second_start]) == rendered
    assert "Wrong. Try again." in tokenizer.decode(experience.token_ids[spans[1]:second_start])
    assert experience.reward == 0.75 and experience.score == 0.25 + 7.0


def test_truncated_response_has_one_logprob_per_token(engine):
    outcome = _run(engine, StepEnvRunner(EchoEnv), _request(max_tokens=1))
    (experience,) = outcome.experiences
    assert sum(experience.action_mask) == 1
    assert len(experience.behavior_logprobs) == len(experience.token_ids) == len(experience.policy_versions)


def test_max_length_bounds_the_segment(engine):
    outcome = _run(engine, StepEnvRunner(TwoTurnEnv), _request(max_turns=2, max_tokens=50, max_length=24))
    (experience,) = outcome.experiences
    assert len(experience.token_ids) <= 24 and experience.truncated


class NotAResultEnv(Env):
    async def step(self, state):
        return {"reward": 1.0}


class RaisingEnv(Env):
    async def step(self, state):
        raise ValueError("grader exploded")


class HangingEnv(Env):
    async def step(self, state):
        await asyncio.sleep(3600)


@pytest.mark.parametrize("env_class, reason, message", [
    (NotAResultEnv, "bad_result", "NotAResultEnv.step returned dict, not molt.agents.Result"),
    (RaisingEnv, "agent_error", "ValueError: grader exploded"),
    (HangingEnv, "timeout", "rollout_timeout_seconds=2"),
])
def test_a_failing_env_fails_only_its_rollout(engine, env_class, reason, message):
    outcome = _run(engine, StepEnvRunner(env_class), _request(), timeout_seconds=2)
    assert outcome.failure == reason and message in outcome.error and outcome.experiences == []


def test_a_hung_rollout_does_not_hold_up_others(engine):
    async def both():
        hung = asyncio.create_task(run_with_timeout(StepEnvRunner(HangingEnv), _request(rollout_id=1),
                                                    engine.engine, engine.engine.tokenizer, 20))
        fine = await run_with_timeout(StepEnvRunner(EchoEnv), _request(rollout_id=2), engine.engine,
                                      engine.engine.tokenizer, 20)
        done_first = not hung.done()
        hung.cancel()
        return fine, done_first

    fine, done_first = engine.run(both())
    assert fine.failure == "" and done_first


def test_load_agent_runner_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="agent.path='.*missing.py' does not exist"):
        load_agent_runner(str(tmp_path / "missing.py"))
    no_runner = tmp_path / "no_runner.py"
    no_runner.write_text("X = 1\n")
    with pytest.raises(AttributeError, match="defines no AgentRunner"):
        load_agent_runner(str(no_runner))
    wrong = tmp_path / "wrong.py"
    wrong.write_text("class AgentRunner:\n    pass\n")
    with pytest.raises(TypeError, match="must subclass StepEnvRunner"):
        load_agent_runner(str(wrong))
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent("""
        from molt.agents import Env, Result, StepEnvRunner
        class E(Env):
            async def step(self, state):
                return Result(reward=1.0)
        class AgentRunner(StepEnvRunner):
            def __init__(self):
                super().__init__(E)
    """))
    assert isinstance(load_agent_runner(str(good)), StepEnvRunner)
