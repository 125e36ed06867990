"""The tool-using addition agent written with LangChain: `ChatOpenAI` with the `calculator` tool
bound, and the agent's own loop running the tool calls the model makes and sending their results
back as `ToolMessage`s until the model answers."""

from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

MAX_TURNS = 4


def run_calculator(question: str) -> str:
    """Evaluates the one-digit addition of the question ('3+5=' -> '8')."""
    left, _, right = question.rstrip("= ").partition("+")
    return str(int(left) + int(right))


class LangChainAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        @tool
        def calculator() -> str:
            """solve the question"""
            return run_calculator(ctx.prompt)

        llm = ChatOpenAI(model=ctx.model_name, base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                         max_tokens=ctx.sampling_params.max_tokens, temperature=ctx.sampling_params.temperature)
        model = llm.bind_tools([calculator])
        messages = list(ctx.messages)
        used_tool = False
        for _ in range(MAX_TURNS):
            reply = await model.ainvoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                answer = reply.content if isinstance(reply.content, str) else ""
                return Result(reward=float(answer.strip() == ctx.label),
                              info={"used_tool": float(used_tool), "answered": 1.0})
            used_tool = True
            for call in reply.tool_calls:
                if call["name"] == calculator.name:
                    messages.append(await calculator.ainvoke(call))  # a ToolMessage answering the call
                else:
                    messages.append(ToolMessage(content=f"no tool named {call['name']!r}", tool_call_id=call["id"]))
        return Result(reward=0.0, info={"used_tool": float(used_tool), "answered": 0.0})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(LangChainAgent)
