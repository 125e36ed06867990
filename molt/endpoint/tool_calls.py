"""Tool calls in generated text: the Qwen/Hermes `<tool_call>` blocks our chat templates teach.

The model writes each call as
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3+5"}}
    </tool_call>
and the endpoint turns each well-formed block into a structured call (OpenAI `tool_calls`,
Anthropic `tool_use`). A block the model botched stays in the text, so nothing it wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One call the model made."""

    id: str  # 'call_<hex>', unique per call
    name: str
    arguments: str  # JSON text of an object


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split generated text into (content outside the tool-call blocks, the calls in order).

    A block whose body is not a JSON object with a string `name` and object `arguments` is not
    a call: its text, tags included, stays in the content. An unclosed `<tool_call>` (a reply cut
    by max_tokens) is content too.
    """
    content_parts: list[str] = []
    calls: list[ToolCall] = []
    position = 0
    for block in TOOL_CALL_BLOCK.finditer(text):
        call = parse_tool_call_body(block.group(1))
        if call is None:
            continue
        content_parts.append(text[position:block.start()])
        calls.append(call)
        position = block.end()
    content_parts.append(text[position:])
    return "".join(content_parts).strip(), calls


def parse_tool_call_body(body: str) -> ToolCall | None:
    """The call inside one `<tool_call>` block, or None when it is not a well-formed call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    # ensure_ascii=False keeps non-ASCII text as the model wrote it, as OpenAI does.
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=call["name"],
                    arguments=json.dumps(arguments, ensure_ascii=False))
