"""Two chat agents in one job, each unchanged: group g runs the AgentRunner of agent file g % 2 of
$MOLT_TEST_AGENTS (two paths, comma-separated), and each rollout that ends appends
"<file stem> <policy version at dispatch> <group>" to $MOLT_TEST_AGENT_LOG. Scenarios that differ
only in their agent share a torchrun job this way (a job costs ~30 s here, a step ~0.2 s)."""

import copy
import os
from pathlib import Path

from molt.agents.base import load_agent_runner
from molt.agents.chat import ChatAgentRunner


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        paths = os.environ["MOLT_TEST_AGENTS"].split(",")
        self.agent_classes, self.names = [], [Path(path).stem for path in paths]
        for path in paths:
            runner = load_agent_runner(path)
            # Their rollouts run through this class's run: each must be a plain ChatAgentRunner.
            assert type(runner).run is ChatAgentRunner.run, f"{path}: AgentRunner overrides run"
            self.agent_classes.append(runner.agent_class)
        super().__init__(self.agent_classes[0])

    async def run(self, request, sampler, tokenizer):
        index = request.group_id % len(self.agent_classes)
        runner = copy.copy(self)  # with the session endpoint and options the agent worker attached
        runner.agent_class = self.agent_classes[index]
        outcome = await ChatAgentRunner.run(runner, request, sampler, tokenizer)
        with open(os.environ["MOLT_TEST_AGENT_LOG"], "a") as log:
            log.write(f"{self.names[index]} {request.policy_version} {request.group_id}\n")
        return outcome
