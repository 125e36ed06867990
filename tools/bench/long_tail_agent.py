"""The agent of tools/bench/async.py: one turn, then a simulated tool call whose latency is drawn
from a long-tailed (log-normal) distribution and capped; the reward varies within a group.

Latency settings come from the environment (the bench sets them; agent workers inherit them):
MOLT_BENCH_LATENCY_MEDIAN_SECONDS, MOLT_BENCH_LATENCY_SIGMA, MOLT_BENCH_LATENCY_CAP_SECONDS.
"""

import asyncio
import math
import os
import random

from molt.agents import Env, Result, StepEnvRunner

MEDIAN_SECONDS = float(os.environ.get("MOLT_BENCH_LATENCY_MEDIAN_SECONDS", "0.1"))
SIGMA = float(os.environ.get("MOLT_BENCH_LATENCY_SIGMA", "1.0"))
CAP_SECONDS = float(os.environ.get("MOLT_BENCH_LATENCY_CAP_SECONDS", "2.0"))


class LongTailToolEnv(Env):
    async def step(self, state):
        await asyncio.sleep(min(CAP_SECONDS, random.lognormvariate(math.log(MEDIAN_SECONDS), SIGMA)))
        return Result(reward=float(len(state.action_text) % 3))


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(LongTailToolEnv)
