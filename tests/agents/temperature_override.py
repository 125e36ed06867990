"""A two-turn agent on the plain OpenAI SDK that samples its first turn at its own temperature
(0.7) and its second at the rollout's: one segment whose tokens carry two temperatures, which the
trainer must recompute each at its own."""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class TemperatureOverrideAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        first = await client.chat.completions.create(model=ctx.model_name, messages=messages, temperature=0.7,
                                                     max_tokens=ctx.sampling_params.max_tokens)
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "Check it once more."}]
        second = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                      max_tokens=ctx.sampling_params.max_tokens)
        answer = (second.choices[0].message.content or "").strip()
        return Result(reward=float(answer == ctx.label))


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(TemperatureOverrideAgent)
