"""The vision demo task as a ChatAgent through the official OpenAI SDK: the prompt is an image of a
one-digit sum "a+b" and a request to write it out with its result; the reply earns reward 1 when it
is the row's label, "a+b=s" for the digits in the image and their sum. Every token counts: a reply
that misreads a digit earns nothing even when its result happens to be right. The row's messages
already hold the image as an image_url part with a data URI (ctx.messages), so they go to the SDK as
they are; Molt's session endpoint captures every token the model sampled and the image it saw.
"""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


class VisionSumAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        response = await client.chat.completions.create(
            model=ctx.model_name, messages=ctx.messages, max_tokens=ctx.sampling_params.max_tokens,
            temperature=ctx.sampling_params.temperature)
        await client.close()
        reply = (response.choices[0].message.content or "").strip()
        # Logged as agent/read_digits: how often the policy reads the image right, whatever its sum.
        read = reply.partition("=")[0] == ctx.label.partition("=")[0]
        return Result(reward=float(reply == ctx.label), info={"read_digits": float(read)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(VisionSumAgent)
