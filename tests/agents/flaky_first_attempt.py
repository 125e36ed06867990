"""A test agent that fails some rollouts, to exercise agent.on_failed_rollout.

Sample 0 of each group with group_id % 4 == 1 raises on its first attempt only (a refill of it,
which keeps the group and sample index, succeeds); sample 0 of each group with group_id % 4 == 3
raises on every attempt. "First attempt" is remembered by the runner, one object per agent
worker, so run it with one rollout rank and one agent worker (the default). Rewards are
varied_reward.py's.
"""

import sys
from pathlib import Path

from molt.agents import StepEnvRunner

sys.path.insert(0, str(Path(__file__).parent))  # the agent file is loaded by path, not as a package
from varied_reward import VariedRewardEnv  # noqa: E402


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(VariedRewardEnv)
        self.attempted: set[tuple[int, int]] = set()

    async def run(self, request, sampler, tokenizer):
        key = (request.group_id, request.sample_index)
        first_attempt = key not in self.attempted
        self.attempted.add(key)
        if request.sample_index == 0 and (request.group_id % 4 == 3 or (request.group_id % 4 == 1 and first_attempt)):
            raise RuntimeError(f"flaky agent: group {request.group_id}, sample 0, first attempt {first_attempt}")
        return await super().run(request, sampler, tokenizer)
