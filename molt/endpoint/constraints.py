"""Guided decoding for what a request demands of the reply's form: a tool call (tool_choice
'required' or a named function) or a JSON reply (response_format). Each becomes the keyword
arguments of vLLM's StructuredOutputsParams, an xgrammar structural tag that spells the calls in
the chat template's own format, so the tool-call parser reads them like any other.

Under a constraint the engine samples from the policy's distribution masked to what the grammar
allows, and reports that distribution's log-probs (a forced token has log-prob 0): the recorded
behaviour log-probs are those the tokens were really sampled with, and the session counts such
replies in the drift ledger as `constrained` (docs/agents.md, the sampling contract).
"""

from __future__ import annotations

import json

from molt.endpoint.messages import ChatRequest
from molt.endpoint.tool_calls import END, START


def build_constraint(chat: ChatRequest) -> dict | None:
    """StructuredOutputsParams keyword arguments for the request, or None when it demands nothing."""
    tools = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"}
             for tool in chat.tools or []}
    mode = chat.tool_choice.mode
    if mode == "function":
        return _structural_tag(_call_tag(chat.tool_choice.name, tools[chat.tool_choice.name]))
    if mode == "required":
        return _structural_tag({"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
                                "tags": [_call_tag(name, schema) for name, schema in tools.items()]})
    if chat.response_format is None:
        return None
    schema = chat.response_format.schema if chat.response_format.kind == "json_schema" else {"type": "object"}
    if mode == "auto" and tools:
        # The reply is either the JSON answer or tool calls, as the model chooses.
        return _structural_tag({"type": "or", "elements": [
            {"type": "json_schema", "json_schema": schema},
            {"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
             "tags": [_call_tag(name, tool_schema) for name, tool_schema in tools.items()]}]})
    return {"json": schema}


def _call_tag(name: str, parameters: dict) -> dict:
    """One call as the template writes it: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""
    return {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": parameters}, "end": f"}}\n{END}"}


def _structural_tag(format_: dict) -> dict:
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": format_})}
