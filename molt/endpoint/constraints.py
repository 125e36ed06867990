"""Guided decoding for what a request demands of the reply's form: a tool call (tool_choice
'required' or a named function) or a JSON reply (response_format). Each becomes the keyword
arguments of vLLM's StructuredOutputsParams: an xgrammar structural tag that spells the calls in
the chat template's own format, so the tool-call parser reads them like any other.

Every JSON value in it (a call's arguments, a JSON reply) is an EBNF grammar that admits exactly
the layout `json.dumps` writes, which is what the templates render and so what a model learns:
`", "` and `": "` between items, no other whitespace. JSON as xgrammar's `json_schema` allows any
whitespace anywhere, and a model pushed off its distribution by the mask then spends its tokens on
runs like `{\\n\\r    \\n\\n` until max_tokens. The grammar constrains text, not tokens: where the
model's own tokenization of the text is allowed (always, for the literal parts), a model that wants
to write the call writes it in its own tokens.

Under a constraint the engine samples from the policy's distribution masked to what the grammar
allows, and reports that distribution's log-probs (a forced token has log-prob 0): the recorded
behaviour log-probs are those the tokens were really sampled with, and the session counts such
replies in the drift ledger as `constrained` (docs/agents.md, the sampling contract). Where the
model does not want what is forced (a call on a turn it would answer in text), every allowed token
is far in its tail: the reply is then spelled in tokens it would never pick (`cal` `cu` `l` `ator`)
and the trainer's log-probs sit far (~20 nats) below the behaviour ones. No grammar form avoids
that; it is the price of forcing.
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
        return _structural_tag(_calls(tools))
    if chat.response_format is None:
        return None
    schema = chat.response_format.schema if chat.response_format.kind == "json_schema" else {"type": "object"}
    if mode == "auto" and tools:
        # The reply is either the JSON answer or tool calls, as the model chooses.
        return _structural_tag({"type": "or", "elements": [_json(schema), _calls(tools)]})
    return _structural_tag(_json(schema))


def _calls(tools: dict[str, dict]) -> dict:
    """One or more calls to any of the tools, one per line, and nothing else."""
    return {"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
            "tags": [_call_tag(name, schema) for name, schema in tools.items()]}


def _call_tag(name: str, parameters: dict) -> dict:
    """One call as the template writes it: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""
    return {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": _json(parameters), "end": f"}}\n{END}"}


def _json(schema: dict) -> dict:
    """A JSON value of the schema in json.dumps layout (see the module docstring)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    return {"type": "grammar", "grammar": str(grammar)}


def _structural_tag(format_: dict) -> dict:
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": format_})}
