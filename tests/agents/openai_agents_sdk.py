"""The tool-using addition agent written with the OpenAI Agents SDK: the Runner's own loop calls
the `calculator` tool when the model asks for it and feeds the result back until the model
answers. MOLT_TEST_AGENTS_API picks the SDK's model: `chat` (OpenAIChatCompletionsModel, the
default) or `responses` (OpenAIResponsesModel: POST /v1/responses, the SDK's default API)."""

import os

from agents import (Agent, MaxTurnsExceeded, ModelBehaviorError, ModelSettings, OpenAIChatCompletionsModel,
                    OpenAIResponsesModel, RunConfig, RunContextWrapper, Runner, ToolCallItem, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI's servers

MAX_TURNS = 4
MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


def run_calculator(question: str) -> str:
    """Evaluates the one-digit addition of the question ('3+5=' -> '8')."""
    left, _, right = question.rstrip("= ").partition("+")
    return str(int(left) + int(right))


@function_tool
def calculator(wrapper: RunContextWrapper[str]) -> str:
    """solve the question"""
    return run_calculator(wrapper.context)


class AgentsChatAgent(ChatAgent):
    # A class attribute, so tests/agents/chat_agents_by_group.py can run both models in one job.
    api = os.environ.get("MOLT_TEST_AGENTS_API", "chat")

    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        settings = ModelSettings(max_tokens=ctx.sampling_params.max_tokens,
                                 temperature=ctx.sampling_params.temperature)
        agent = Agent(name="adder", tools=[calculator], model_settings=settings,
                      model=MODELS[self.api](
                          model=ctx.model_name, openai_client=client))
        try:
            result = await Runner.run(agent, list(ctx.messages), context=ctx.prompt, max_turns=MAX_TURNS,
                                      run_config=RunConfig(tracing_disabled=True))
        except (MaxTurnsExceeded, ModelBehaviorError):  # the model kept calling, or called a tool it lacks
            return Result(reward=0.0, info={"used_tool": 1.0, "answered": 0.0})
        used_tool = any(isinstance(item, ToolCallItem) for item in result.new_items)
        answer = str(result.final_output or "").strip()
        return Result(reward=float(answer == ctx.label), info={"used_tool": float(used_tool), "answered": 1.0})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(AgentsChatAgent)
