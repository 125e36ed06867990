"""The vision demo task as a ChatAgent through the official OpenAI SDK: the prompt is an image of a
one-digit sum "a+b" and a question; the reply earns reward 1 when the number it ends with (after
its last "=", e.g. "3+4=7") is the sum. The row's messages already hold the image as an image_url
part with a data URI (ctx.messages), so they go to the SDK as they are; Molt's session endpoint
captures every token the model sampled and the image it saw.
"""

import re

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result


def final_number(text: str) -> str:
    """The answer a reply gives: what follows its last '=' (the whole reply without one), stripped."""
    return text.rpartition("=")[2].strip()


class VisionSumAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        response = await client.chat.completions.create(
            model=ctx.model_name, messages=ctx.messages, max_tokens=ctx.sampling_params.max_tokens,
            temperature=ctx.sampling_params.temperature)
        await client.close()
        reply = response.choices[0].message.content or ""
        answer = final_number(reply)
        # Whether the reply restates the digits it read ("a+b=..."): how well the policy reads the image.
        read = re.fullmatch(r"\s*(\d)\+(\d)=.*", reply, flags=re.S)
        digits = ctx.label and read and int(read.group(1)) + int(read.group(2)) == int(ctx.label)
        return Result(reward=float(answer == ctx.label), info={"read_digits_summing_right": float(bool(digits))})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(VisionSumAgent)
