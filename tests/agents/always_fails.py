"""A test agent whose every rollout fails, as one whose every request got a 404 did: its ChatAgent
asks the session endpoint for a route that does not exist (agent.max_failed_steps)."""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result


class MisconfiguredAgent(ChatAgent):
    async def run(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url + "/no-such-route", api_key=ctx.api_key, max_retries=0)
        response = await client.chat.completions.create(model=ctx.model_name, messages=list(ctx.messages),
                                                        max_tokens=ctx.sampling_params.max_tokens)
        return Result(reward=float(response.choices[0].message.content == ctx.label))


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MisconfiguredAgent)
