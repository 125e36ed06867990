"""The tool-using addition agent of addition_tool_openai.py, driven through the Anthropic SDK."""

from anthropic import AsyncAnthropic

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

CALCULATOR_TOOL = {"name": "calculator", "description": "solve the question", "input_schema": {"type": "object"}}


def run_calculator(question: str) -> str:
    """Evaluates the one-digit addition of the question ('3+5=' -> '8')."""
    left, _, right = question.rstrip("= ").partition("+")
    return str(int(left) + int(right))


class AdditionToolAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "user", "content": ctx.prompt}]
        # This SDK's messages.create has no temperature argument; the endpoint reads it from the body.
        sampling = {"max_tokens": ctx.sampling_params.max_tokens,
                    "extra_body": {"temperature": ctx.sampling_params.temperature}}
        response = await client.messages.create(model=ctx.model_name, messages=messages, tools=[CALCULATOR_TOOL], **sampling)
        calls = [block for block in response.content if block.type == "tool_use"]
        if calls:
            messages.append({"role": "assistant", "content": [block.model_dump() for block in response.content]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": run_calculator(ctx.prompt)}]})
            response = await client.messages.create(model=ctx.model_name, messages=messages, tools=[CALCULATOR_TOOL],
                                                    **sampling)
        answer = "".join(block.text for block in response.content if block.type == "text").strip()
        return Result(reward=float(answer == ctx.label), info={"used_tool": float(bool(calls))})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(AdditionToolAgent)
