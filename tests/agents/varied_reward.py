"""A test Env whose reward varies within a group even for a random policy, so gradients are nonzero."""

from molt.agents import Env, Result, StepEnvRunner


class VariedRewardEnv(Env):
    async def step(self, state):
        return Result(reward=float(len(state.action_text) % 3), info={"response_chars": float(len(state.action_text))})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(VariedRewardEnv)
