"""The issue's Anthropic seed program, as written, plus a `grade`."""

from anthropic import AsyncAnthropic

from molt.agents import ChatAgent, ChatAgentRunner, Result


def grade(text: str | None, label: str) -> float:
    return float((text or "").strip() == label)


class MyAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)
        response = await client.messages.create(model=ctx.model_name,
            messages=[{"role": "user", "content": ctx.prompt}], max_tokens=ctx.sampling_params.max_tokens)
        return Result(reward=grade(response.content[0].text, ctx.label))


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MyAgent)
