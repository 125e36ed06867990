"""The tool-using addition agent written with pydantic-ai: an OpenAI chat model through the OpenAI
provider, the `calculator` tool, and a structured output (`Answer`). By default pydantic-ai asks
for structured output as a call of its own `final_result` tool, and since the run may end only
through it, it sends tool_choice "required"."""

from openai import AsyncOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext, UsageLimits
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

MAX_REQUESTS = 4


class Answer(BaseModel):
    answer: int


def run_calculator(question: str) -> str:
    """Evaluates the one-digit addition of the question ('3+5=' -> '8')."""
    left, _, right = question.rstrip("= ").partition("+")
    return str(int(left) + int(right))


adder = Agent(output_type=Answer, deps_type=str)


@adder.tool
def calculator(run_ctx: RunContext[str]) -> str:
    """solve the question"""
    return run_calculator(run_ctx.deps)


class PydanticAIAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        model = OpenAIChatModel(ctx.model_name, provider=OpenAIProvider(openai_client=client))
        settings = {"max_tokens": ctx.sampling_params.max_tokens, "temperature": ctx.sampling_params.temperature}
        try:
            result = await adder.run(ctx.prompt, model=model, deps=ctx.prompt, model_settings=settings,
                                     usage_limits=UsageLimits(request_limit=MAX_REQUESTS))
        except (UnexpectedModelBehavior, UsageLimitExceeded):  # no valid Answer within the budget
            return Result(reward=0.0, info={"answered": 0.0})
        return Result(reward=float(str(result.output.answer) == ctx.label), info={"answered": 1.0})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(PydanticAIAgent)
