"""Several chat agents in one job, each unchanged: group g runs agent g % N of $MOLT_TEST_AGENTS
(N entries, comma-separated: an agent file's path, or PATH:NAME=VALUE to run its agent class with
that class attribute set), and each rollout that ends appends a JSON line to $MOLT_TEST_AGENT_LOG:
the entry's name, the policy version at dispatch, the group, its segments and its session's drift
ledger. Scenarios that differ only in their agent share a torchrun job this way (a job costs ~60 s
of CPU here, a step of the tiny model ~0.2 s)."""

import copy
import json
import os
from pathlib import Path

from molt.agents.base import load_agent_runner
from molt.agents.chat import ChatAgentRunner


def _load(entry: str) -> tuple[str, type]:
    path, _, setting = entry.partition(":")
    runner = load_agent_runner(path)
    # Its rollouts run through this class's run: it must be a plain ChatAgentRunner.
    assert type(runner).run is ChatAgentRunner.run, f"{path}: AgentRunner overrides run"
    if not setting:
        return Path(path).stem, runner.agent_class
    name, _, value = setting.partition("=")
    return f"{Path(path).stem}:{value}", type(runner.agent_class.__name__, (runner.agent_class,), {name: value})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        self.names, self.agent_classes = zip(*(_load(entry) for entry in os.environ["MOLT_TEST_AGENTS"].split(",")))
        super().__init__(self.agent_classes[0])

    async def run(self, request, sampler, tokenizer):
        index = request.group_id % len(self.agent_classes)
        runner = copy.copy(self)  # with the session endpoint and options the agent worker attached
        runner.agent_class = self.agent_classes[index]
        outcome = await ChatAgentRunner.run(runner, request, sampler, tokenizer)
        record = {"agent": self.names[index], "version": request.policy_version, "group": request.group_id,
                  "segments": len(outcome.experiences), "ledger": outcome.ledger}
        with open(os.environ["MOLT_TEST_AGENT_LOG"], "a") as log:
            log.write(json.dumps(record) + "\n")
        return outcome
