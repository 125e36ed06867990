"""The demo task as a ChatAgent with one tool, driven through the official OpenAI SDK.

The model may answer directly or call `calculator` (no arguments: it solves the question); the
agent runs the tool and sends the result back; the final answer earns reward 1 if it is the
exact sum. RL has to learn that calling the tool pays. The trainer learns from every token the
model sampled in both turns (captured by Molt's session endpoint: nothing to do here).
"""

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

CALCULATOR_TOOL = {"type": "function", "function": {"name": "calculator", "description": "solve the question",
                                                    "parameters": {"type": "object"}}}


def run_calculator(question: str) -> str:
    """Evaluates the one-digit addition of the question ('3+5=' -> '8')."""
    left, _, right = question.rstrip("= ").partition("+")
    return str(int(left) + int(right))


class AdditionToolAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        sampling = {"max_tokens": ctx.sampling_params.max_tokens, "temperature": ctx.sampling_params.temperature}
        response = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                        tools=[CALCULATOR_TOOL], **sampling)
        message = response.choices[0].message
        used_tool = bool(message.tool_calls)
        if used_tool:
            call = message.tool_calls[0]
            messages.append({"role": "assistant", "content": message.content,
                             "tool_calls": [call.model_dump()]})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_calculator(ctx.prompt)})
            response = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                            tools=[CALCULATOR_TOOL], **sampling)
            message = response.choices[0].message
        answer = (message.content or "").strip()
        return Result(reward=float(answer == ctx.label), info={"used_tool": float(used_tool)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(AdditionToolAgent)
