"""The demo task as an Env: the policy answers a one-digit addition; reward 1 for the exact sum."""

from molt.agents import Env, Result, StepEnvRunner, StepState


class AdditionEnv(Env):
    async def step(self, state: StepState) -> Result:
        answer = state.action_text.strip()
        correct = answer == state.label
        return Result(reward=1.0 if correct else 0.0, info={"answer_is_number": float(answer.isdigit())})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(AdditionEnv)
