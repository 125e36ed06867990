"""A test Env with simulated tool latency: every step first waits 0-0.3 s (asyncio.sleep), the first
answer gets one more turn, and rewards vary within a group. Under algorithm.max_staleness > 0 its
rollouts are still running when a refit lands, often between their two turns."""

import asyncio
import random

from molt.agents import Env, Result, StepEnvRunner


class SlowTwoTurnEnv(Env):
    async def step(self, state):
        await asyncio.sleep(random.uniform(0.0, 0.3))
        if state.turn == 0:
            return Result(reward=float(len(state.action_text) % 2), terminated=False, observation="Again.")
        return Result(reward=float(len(state.action_text) % 3))


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(SlowTwoTurnEnv)
