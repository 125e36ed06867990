"""A math agent with a calculator tool, driven through the official OpenAI SDK.

Each prompt row is a problem with its final numeric answer as `label` (e.g. GSM8K or DAPO-Math
converted to {"prompt": ..., "label": "42"}). The model may call `calculate(expression)` in up to
MAX_TURNS - 1 turns; the agent evaluates the arithmetic (no Python eval: numbers, + - * / // % ** and
parentheses) and sends the result back. The last message is graded with math-verify (the
`math-verify` package): reward 1 if the answer it extracts (a \\boxed{...} first, else an answer
it finds in the text) is mathematically equal to the label ("\\boxed{1/2}" matches "0.5").
"""

import ast
import json
import operator
import threading

import math_verify
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, ChatContext, Result

MAX_TURNS = 5  # model calls per rollout; one still calling the tool after them has no answer
CALCULATE_TOOL = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression, e.g. (17 * 23) / 4",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # with MAX_INTEGER_BITS, keeps 9 ** 9 ** 9 from stalling the agent worker
MAX_INTEGER_BITS = 1024
GRADING_TIMEOUT_SECONDS = 5  # math-verify's limit on parsing a text and on comparing two answers


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is above {MAX_EXPONENT}")
        value = OPERATORS[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
            raise ValueError(f"result above 2**{MAX_INTEGER_BITS}")
        return value
    raise ValueError(f"unsupported {type(node).__name__}")


def calculate(arguments: str) -> str:
    """The tool: '{"expression": "2 * (3 + 4)"}' -> '14'; a problem comes back as 'error: ...'."""
    try:
        value = evaluate(ast.parse(str(json.loads(arguments)["expression"]), mode="eval"))
        return str(value) if isinstance(value, int) else f"{value:.10g}"
    except (ValueError, TypeError, KeyError, SyntaxError, ZeroDivisionError, OverflowError,
            RecursionError) as error:
        return f"error: {error}"


def grade(reply: str, label: str) -> bool:
    """Whether math-verify finds `reply`'s final answer equal to `label`. Its time limits use
    SIGALRM, which only the main thread may set (an agent worker runs agents there); on another
    thread (`asyncio.to_thread`, a test's thread) it runs without them."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    timeout = GRADING_TIMEOUT_SECONDS if on_main_thread else None
    gold = math_verify.parse(label, parsing_timeout=timeout)
    answer = math_verify.parse(reply, parsing_timeout=timeout)
    return math_verify.verify(gold, answer, timeout_seconds=timeout)


class MathToolAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = list(ctx.messages)
        sampling = {"max_tokens": ctx.sampling_params.max_tokens, "temperature": ctx.sampling_params.temperature}
        num_tool_calls = 0
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(model=ctx.model_name, messages=messages,
                                                            tools=[CALCULATE_TOOL], **sampling)
            message = response.choices[0].message
            if not message.tool_calls:
                break
            messages.append({"role": "assistant", "content": message.content,
                             "tool_calls": [call.model_dump() for call in message.tool_calls]})
            for call in message.tool_calls:
                num_tool_calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
        correct = grade(message.content or "", ctx.label)
        return Result(reward=float(correct), info={"tool_calls": float(num_tool_calls)})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MathToolAgent)
