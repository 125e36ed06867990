"""Tool calls in generated text, parsed incrementally: one parser feeds every API, streamed or not.

The chat templates Molt ships (Qwen/Hermes style) teach the model to write each call as
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3+5"}}
    </tool_call>
`ToolCallParser` takes the generated text in pieces as they arrive and gives back, in order, the
text that is certainly content and each complete, well-formed call. A non-streamed reply is the
same parser fed the whole text at once, so a streamed reply equals the non-streamed one by
construction. The rules:

- text outside blocks is content; text that could still be the start of a block is held back
  until it is known not to be one;
- a block whose body is not a JSON object with a string `name` and object `arguments` is
  content, tags included, so nothing the model wrote is lost; so is an unclosed block (a reply
  cut at max_tokens) when the text ends;
- whitespace between content and a call is dropped (templates put a newline there), and so is
  whitespace right after a call.
"""

from __future__ import annotations

import json
import uuid

from molt.endpoint.messages import ToolCall

START = "<tool_call>"
END = "</tool_call>"


class ToolCallParser:
    """Incremental: `feed(text)` and at the end `finish()`, each returning new content strings
    and ToolCalls in order. With `enabled=False` every character is content (tool_choice 'none')."""

    def __init__(self, *, enabled: bool = True):
        self.enabled = enabled
        self._buffer = ""  # text not yet decided
        self._inside = False  # the buffer starts with START
        self._held_space = ""  # trailing whitespace of the content so far: dropped if a call follows
        self._after_call = False  # drop whitespace until the next content

    def feed(self, text: str) -> list[str | ToolCall]:
        if not self.enabled:
            return [text] if text else []
        self._buffer += text
        out: list[str | ToolCall] = []
        while True:
            if not self._inside:
                start = self._buffer.find(START)
                if start < 0:
                    keep = _partial_marker_length(self._buffer)
                    self._content(self._buffer[:len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                self._content(self._buffer[:start], out)
                self._buffer, self._inside = self._buffer[start:], True
            end = self._buffer.find(END)
            if end < 0:
                return out
            block, self._buffer, self._inside = self._buffer[:end + len(END)], self._buffer[end + len(END):], False
            call = parse_tool_call_body(block[len(START):end])
            if call is None:
                self._content(block, out)
            else:
                self._held_space, self._after_call = "", True
                out.append(call)

    def finish(self) -> list[str | ToolCall]:
        """The rest: an unclosed block or a partial marker is content; so is held whitespace."""
        if not self.enabled:
            return []
        out: list[str | ToolCall] = []
        self._content(self._buffer, out)
        self._buffer, self._inside = "", False
        if self._held_space:
            out.append(self._held_space)
            self._held_space = ""
        return merged_parts(out)

    def _content(self, text: str, out: list) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_space + text
        core = text.rstrip()
        self._held_space = text[len(core):]
        if core:
            if out and isinstance(out[-1], str):
                out[-1] += core
            else:
                out.append(core)


def parse_all(text: str, *, enabled: bool = True) -> list[str | ToolCall]:
    """The parts of a whole generated text, as a fresh parser sees it."""
    parser = ToolCallParser(enabled=enabled)
    return merged_parts(parser.feed(text) + parser.finish())


def parse_tool_call_body(body: str) -> ToolCall | None:
    """The call inside one block, or None when it is not a well-formed call."""
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


def _partial_marker_length(text: str) -> int:
    """How many characters at the end of `text` could be the start of START."""
    for keep in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-keep:]):
            return keep
    return 0


def merged_parts(parts: list[str | ToolCall]) -> list[str | ToolCall]:
    """Adjacent strings joined, empty ones dropped."""
    out: list[str | ToolCall] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif not (isinstance(part, str) and not part):
            out.append(part)
    return out


class VllmToolCallParser:
    """A vLLM tool parser by name (rollout.tool_call_parser: llama3_json, mistral, deepseek_v3,
    pythonic, ...), for model families whose templates write calls in another format than the
    `<tool_call>` blocks. vLLM's parsers read a whole reply, so a streamed reply's text is held
    back until the reply ends and then parsed at once: the streamed reply still equals the
    non-streamed one, it only arrives later. Content is the text vLLM's parser leaves outside the
    calls; with tool_choice 'none' (enabled=False) the text streams as it comes."""

    def __init__(self, parser, *, enabled: bool = True):
        self.parser = parser
        self.enabled = enabled
        self._text = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        if not self.enabled:
            return [text] if text else []
        self._text += text
        return []

    def finish(self) -> list[str | ToolCall]:
        if not self.enabled or not self._text:
            return []
        extracted = self.parser.extract_tool_calls(self._text, None)
        if not extracted.tools_called:
            return [self._text]
        calls = [ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=call.function.name,
                          arguments=call.function.arguments or "{}") for call in extracted.tool_calls]
        return merged_parts([extracted.content or "", *calls])


def build_tool_call_parser_factory(name: str, tokenizer):
    """A function `enabled -> parser` for rollout.tool_call_parser `name`: Molt's incremental
    parser for 'hermes' (the `<tool_call>` blocks of Qwen and Hermes templates), else vLLM's parser
    of that name, checked once here so a bad name fails at start-up."""
    if name == "hermes":
        return lambda enabled: ToolCallParser(enabled=enabled)
    from vllm.tool_parsers import ToolParserManager

    try:
        parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    except KeyError:
        raise ValueError(f"rollout.tool_call_parser={name!r} is not a vLLM tool parser; use 'hermes' or one of "
                         f"{', '.join(sorted(ToolParserManager.list_registered()))}") from None
    except RuntimeError as error:  # the parser's tokens are not in this tokenizer
        raise ValueError(f"rollout.tool_call_parser={name!r} does not fit model.path's tokenizer: {error}") from None
    return lambda enabled: VllmToolCallParser(parser, enabled=enabled)
