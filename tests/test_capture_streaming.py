"""Streamed replies equal non-streamed ones, through the real endpoint and the real SDKs, for any
scripted engine output: complete calls, cut calls, junk blocks, text before, between and after
calls, several calls, split anywhere into engine steps."""

import json

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_engine import Script, ScriptedEndpoint

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Add.",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": "calc", "description": "Add.",
                    "input_schema": {"type": "object", "properties": {"e": {"type": "string"}}}}]
USER = [{"role": "user", "content": "3+5="}]


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from transformers import AutoTokenizer

    server = ScriptedEndpoint(AutoTokenizer.from_pretrained(tiny_model_dir))
    yield server
    server.close()


def call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calc", "arguments": {"e": expression}}) + "\n</tool_call>"


PIECES = st.one_of(
    st.text(alphabet=" \nab8+=.é", min_size=1, max_size=10),
    st.builds(call, st.sampled_from(["1+1", "é+2", "3"])),
    st.just("<tool_call>\nnot json\n</tool_call>"),
    st.just("\n"),
)
CUT_CALL = '<tool_call>\n{"name": "calc", "arguments": {"e": "1'


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = [0] + sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


def openai_message(completion) -> tuple:
    message = completion.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    return message.content, calls, completion.choices[0].finish_reason


def anthropic_blocks(message) -> tuple:
    blocks = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]
    return blocks, message.stop_reason


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(PIECES, min_size=1, max_size=6), cut_at_end=st.booleans(), data=st.data())
def test_streamed_and_plain_replies_are_equal_in_both_apis(scripted, pieces, cut_at_end, data):
    text = "".join(pieces) + (CUT_CALL if cut_at_end else "")
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    session = scripted.open_session()
    try:
        scripted.engine.play(Script(chunked(text, cuts)), Script([text]), Script(chunked(text, cuts)), Script([text]))
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        with client.chat.completions.stream(model="m", messages=USER, tools=TOOLS) as stream:
            streamed = openai_message(stream.get_final_completion())
        plain = openai_message(client.chat.completions.create(model="m", messages=USER, tools=TOOLS))
        assert streamed == plain

        client = anthropic.Anthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
        with client.messages.stream(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS) as stream:
            streamed_blocks = anthropic_blocks(stream.get_final_message())
        plain_blocks = anthropic_blocks(client.messages.create(model="m", max_tokens=64, messages=USER,
                                                               tools=ANTHROPIC_TOOLS))
        assert streamed_blocks == plain_blocks
        # Both APIs carry the same text and calls.
        text_parts = "".join(b[1] for b in plain_blocks[0] if b[0] == "text")
        assert (plain[0] or "") == text_parts
        assert plain[1] == [(b[1], b[2]) for b in plain_blocks[0] if b[0] == "tool_use"]
    finally:
        scripted.endpoint.close_session(session)


def test_text_after_a_call_and_a_cut_call_reach_both_apis(scripted):
    """The cases the old streaming dropped: text after a call, a call cut at max_tokens, junk."""
    text = "Let me see.\n" + call("1+1") + "\nThen: " + "<tool_call>\njunk\n</tool_call>" + " and " + CUT_CALL
    session = scripted.open_session()
    try:
        scripted.engine.play(Script([text[:20], text[20:]], finish_reason="length"),
                             Script([text[:15], text[15:]], finish_reason="length"))
        client = anthropic.Anthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
        with client.messages.stream(model="m", max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS) as stream:
            message = stream.get_final_message()
        assert [b.type for b in message.content] == ["text", "tool_use", "text"]
        assert message.content[2].text == "Then: <tool_call>\njunk\n</tool_call> and " + CUT_CALL
        assert message.stop_reason == "max_tokens"
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        chunks = list(client.chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == "Let me see.Then: <tool_call>\njunk\n</tool_call> and " + CUT_CALL
    finally:
        scripted.endpoint.close_session(session)


def test_tool_choice_none_keeps_the_prompt_and_returns_calls_as_text(scripted):
    session = scripted.open_session()
    try:
        scripted.engine.play(Script([call("1")]), Script([call("1")]))
        client = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        auto = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
        none = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="none")
        assert auto.choices[0].message.tool_calls and none.choices[0].message.tool_calls is None
        assert none.choices[0].message.content == call("1")
        first, second = scripted.engine.requests[-2:]
        assert first["token_ids"] == second["token_ids"]  # the tools are rendered either way
    finally:
        scripted.endpoint.close_session(session)


def test_stop_sequence_and_real_input_tokens_in_anthropic_replies(scripted):
    session = scripted.open_session()
    try:
        scripted.engine.play(Script(["4"], stop_reason="\n\n"), Script(["4"], stop_reason="\n\n"))
        client = anthropic.Anthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
        plain = client.messages.create(model="m", max_tokens=8, messages=USER, stop_sequences=["\n\n"])
        assert (plain.stop_reason, plain.stop_sequence) == ("stop_sequence", "\n\n")
        events = list(client.messages.create(model="m", max_tokens=8, messages=USER, stop_sequences=["\n\n"],
                                             stream=True))
        assert events[0].type == "message_start"
        assert events[0].message.usage.input_tokens == plain.usage.input_tokens > 0
        delta = [e for e in events if e.type == "message_delta"][0]
        assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", "\n\n")
        counted = client.messages.count_tokens(model="m", messages=USER)
        assert counted.input_tokens == plain.usage.input_tokens
    finally:
        scripted.endpoint.close_session(session)
