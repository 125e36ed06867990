"""A reasoning-gym task as an Env: the reward is the package's own `score_answer` on the policy's reply.

Rows come from tools/make_reasoning_gym_data.py: `metadata["reasoning_gym"]` holds the package's
entry (question, answer, metadata), and the entry's `metadata["source_dataset"]` names the dataset
whose scorer grades it. The answer is the reply with surrounding whitespace removed (the policy is
warm-started to answer bare, without the package's <answer> tags); grading is the package's.
"""

import functools

import reasoning_gym

from molt.agents import Env, Result, StepEnvRunner, StepState


@functools.cache
def score_answer_fn(dataset: str):
    """The package's scorer of `dataset`, built once per agent worker."""
    return reasoning_gym.get_score_answer_fn(dataset)


def score(reply: str, entry: dict) -> float:
    return float(score_answer_fn(entry["metadata"]["source_dataset"])(reply.strip(), entry))


class ReasoningGymEnv(Env):
    async def step(self, state: StepState) -> Result:
        entry = (state.metadata or {}).get("reasoning_gym")
        if entry is None:
            raise ValueError("the prompt row has no metadata.reasoning_gym entry; write the rows with "
                             "tools/make_reasoning_gym_data.py")
        reward = score(state.action_text, entry)
        return Result(reward=reward, info={"exact": float(reward == 1.0)})


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(ReasoningGymEnv)
