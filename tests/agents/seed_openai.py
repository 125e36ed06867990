"""The issue's OpenAI seed program, as written, plus a `grade`."""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result


def grade(text: str | None, label: str) -> float:
    return float((text or "").strip() == label)


class MyAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        response = await client.chat.completions.create(model=ctx.model_name, messages=list(ctx.messages),
            max_tokens=ctx.sampling_params.max_tokens, temperature=ctx.sampling_params.temperature)
        return Result(reward=grade(response.choices[0].message.content, ctx.label))


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MyAgent)
