"""A test agent that misbehaves inside its agent worker process, on cue.

With MOLT_TEST_FAULTS_DIR set, every rollout appends "pid group_id sample_index vllm_imported" to
`served` in that directory, and
- sample 0 of group KILL_GROUP kills its own worker process (SIGKILL), once (marker `killed`,
  holding the killed pid);
- sample 0 of group BLOCK_GROUP blocks its worker's event loop with time.sleep for BLOCK_SECONDS,
  once (marker `blocked`);
- a request whose metadata has "block_seconds" blocks for that long, every time.
Rewards are varied_reward.py's.
"""

import os
import signal
import sys
import time
from pathlib import Path

from molt.agents import StepEnvRunner

sys.path.insert(0, str(Path(__file__).parent))  # the agent file is loaded by path, not as a package
from varied_reward import VariedRewardEnv  # noqa: E402

KILL_GROUP = 1
BLOCK_GROUP = 4
BLOCK_SECONDS = 1.5


def _once(marker: Path) -> bool:
    """True the first time any worker asks for this marker."""
    try:
        with open(marker, "x") as file:
            file.write(str(os.getpid()))
        return True
    except FileExistsError:
        return False


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(VariedRewardEnv)

    async def run(self, request, sampler, tokenizer):
        if os.environ.get("MOLT_TEST_FAULTS_DIR"):
            directory = Path(os.environ["MOLT_TEST_FAULTS_DIR"])
            with open(directory / "served", "a") as file:
                file.write(f"{os.getpid()} {request.group_id} {request.sample_index} {int('vllm' in sys.modules)}\n")
            first_sample = request.sample_index == 0
            if first_sample and request.group_id == KILL_GROUP and _once(directory / "killed"):
                os.kill(os.getpid(), signal.SIGKILL)
            if first_sample and request.group_id == BLOCK_GROUP and _once(directory / "blocked"):
                time.sleep(BLOCK_SECONDS)  # the bug under test: a blocking call in async code
        if (request.metadata or {}).get("block_seconds"):
            time.sleep(request.metadata["block_seconds"])
        return await super().run(request, sampler, tokenizer)
