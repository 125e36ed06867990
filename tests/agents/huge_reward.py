"""A test Env whose rewards are finite but absurdly large (a reward-scale bug): with dr_grpo's
unnormalized advantages the gradient norm overflows to inf, which the non-finite guard must catch."""

import random

from molt.agents import Env, Result, StepEnvRunner


class HugeRewardEnv(Env):
    async def step(self, state):
        return Result(reward=1e30 if random.random() < 0.5 else 0.0)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(HugeRewardEnv)
