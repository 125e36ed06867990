"""A two-turn variant of the demo task: a wrong first answer gets feedback and one more try.

The reward is 1 for a right first answer, 0.5 for a right second answer, 0 otherwise.
"""

from molt.agents import Env, Result, StepEnvRunner, StepState


class AdditionRetryEnv(Env):
    async def step(self, state: StepState) -> Result:
        correct = state.action_text.strip() == state.label
        if correct:
            return Result(reward=1.0 if state.turn == 0 else 0.5)
        if state.turn == 0:
            return Result(reward=0.0, terminated=False, observation="Wrong. Try again.")
        return Result(reward=0.0)


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(AdditionRetryEnv)
