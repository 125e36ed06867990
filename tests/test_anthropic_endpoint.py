"""The Anthropic Messages route: request conversion, response building, and the real Anthropic SDK
(sync and async, streaming and not) against the real endpoint and vLLM CPU engine."""

import asyncio
import json

import anthropic
import pytest
from anthropic.types import Message
from scripted_engine import Script, ScriptedEndpoint

from molt.endpoint.anthropic_messages import build_message, parse_messages_request
from molt.endpoint.errors import RequestError
from molt.endpoint.messages import Reply, ToolCall

CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
              "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                               "required": ["expression"]}}
TOOL_HISTORY = [
    {"role": "user", "content": "What is 3+5?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me compute."},
        {"type": "tool_use", "id": "toolu_01", "name": "calculator", "input": {"expression": "3+5"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "8"},
        {"type": "text", "text": "Now answer."}]},
]


def _body(**fields) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}


# -- request conversion -----------------------------------------------------------------------


def test_tool_history_converts_to_normalized_chat_in_order():
    parsed = parse_messages_request(_body(system="Be brief.", messages=TOOL_HISTORY, tools=[CALCULATOR]))
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3+5?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"name": "calculator", "arguments": {"expression": "3+5"}}]},
        {"role": "tool", "content": "8"},
        {"role": "user", "content": "Now answer."},
    ]
    assert parsed.tools == [{"type": "function", "function": {
        "name": "calculator", "parameters": CALCULATOR["input_schema"], "description": CALCULATOR["description"]}}]


def test_tool_results_come_first_each_as_one_message_and_blocks_join():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "results:"},
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "1"},
                                                                {"type": "text", "text": "2"}]},
        {"type": "tool_result", "tool_use_id": "b", "content": "boom", "is_error": True},
        {"type": "tool_result", "tool_use_id": "c"}]}]
    parsed = parse_messages_request(_body(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                                          messages=messages))
    assert parsed.messages == [
        {"role": "system", "content": "A\nB"},
        {"role": "tool", "content": "1\n2"},
        {"role": "tool", "content": "Error: boom"},
        {"role": "tool", "content": ""},
        {"role": "user", "content": "results:"},
    ]
    only_results = parse_messages_request(_body(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "1"}]}]))
    assert only_results.messages == [{"role": "tool", "content": "1"}]
    empty_turn = parse_messages_request(_body(messages=[{"role": "user", "content": []}]))
    assert empty_turn.messages == [{"role": "user", "content": ""}]


def test_sampling_fields_and_tool_choice():
    parsed = parse_messages_request(_body(max_tokens=5, temperature=0.5, top_p=1, top_k=-1, stop_sequences=["\n\n"],
                                          stream=True, metadata={"user_id": "u"}, tools=[CALCULATOR]))
    sampling = parsed.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.stop, sampling.seed) == (5, 0.5, ("\n\n",), None)
    assert parsed.stream and len(parsed.tools) == 1
    # tool_choice none keeps the tools (the prompt does not change); any / tool force a call.
    for kind, mode in (("none", "none"), ("auto", "auto"), ("any", "required")):
        parsed = parse_messages_request(_body(tools=[CALCULATOR], tool_choice={"type": kind}))
        assert parsed.tools is not None and parsed.tool_choice.mode == mode
    named = parse_messages_request(_body(tools=[CALCULATOR], tool_choice={"type": "tool", "name": "calculator"}))
    assert (named.tool_choice.mode, named.tool_choice.name) == ("function", "calculator")
    assert parse_messages_request(_body()).sampling.temperature is None  # unset keeps the rollout's value


BAD_BODIES = {
    "missing max_tokens": ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "'max_tokens' is required"),
    "max_tokens a string": (_body(max_tokens="8"), "'max_tokens' must be a positive integer"),
    "max_tokens zero": (_body(max_tokens=0), "'max_tokens' must be a positive integer"),
    "messages a string": (_body(messages="hi"), "'messages' must be a non-empty list"),
    "empty messages": (_body(messages=[]), "'messages' must be a non-empty list"),
    "unknown role": (_body(messages=[{"role": "system", "content": "hi"}]),
                     "messages[0].role must be 'user' or 'assistant'"),
    "content a number": (_body(messages=[{"role": "user", "content": 3}]),
                         "messages[0].content must be a string or a list of content blocks"),
    "image block": (_body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
        "messages[1].content[0]: image blocks are accepted in user turns and tool results only"),
    "tool_use without input": (_body(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "calculator"}]}]), "messages[0].content[0].input must be an object"),
    "temperature a string": (_body(temperature="hot"), "'temperature' must be a number"),
    "top_p zero": (_body(top_p=0), "top_p=0 must be a number in (0, 1]"),
    "top_p below one": (_body(top_p=0.9), "top_p=0.9 is not supported"),
    "top_k": (_body(top_k=5), "top_k=5 is not supported"),
    "thinking": (_body(thinking={"type": "enabled", "budget_tokens": 1024}), "'thinking' is not supported"),
    "stream not a bool": (_body(stream="yes"), "'stream' must be a boolean"),
    "tool without schema": (_body(tools=[{"name": "calculator"}]), "tools[0].input_schema must be"),
    "forced tool without tools": (_body(tool_choice={"type": "any"}), "needs at least one tool"),
    "unknown named tool": (_body(tools=[CALCULATOR], tool_choice={"type": "tool", "name": "x"}), "not in 'tools'"),
    "system a number": (_body(system=3), "system must be a string or a list of content blocks"),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_request_bodies_raise_request_error_400(case):
    body, message = BAD_BODIES[case]
    with pytest.raises(RequestError) as raised:
        parse_messages_request(body)
    assert raised.value.status == 400 and message in raised.value.message


# -- response building ------------------------------------------------------------------------


def _tool_reply() -> Reply:
    call = ToolCall(id="call_abc", name="calculator", arguments='{"expression": "3+5"}')
    return Reply(parts=["Let me compute.", call], finish_reason="tool_calls", prompt_tokens=17, completion_tokens=9)


def test_message_with_tool_calls_is_a_valid_sdk_message():
    message = Message.model_validate(build_message(_tool_reply(), model="molt-tiny"))
    assert message.id.startswith("msg_") and message.model == "molt-tiny" and message.role == "assistant"
    text, tool_use = message.content
    assert text.type == "text" and text.text == "Let me compute."
    assert tool_use.type == "tool_use" and tool_use.id.startswith("toolu_") and tool_use.name == "calculator"
    assert tool_use.input == {"expression": "3+5"}
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (17, 9)


def test_message_stop_reasons_and_text_blocks():
    def reply(parts, finish_reason, stop_sequence=None):
        return Reply(parts=parts, finish_reason=finish_reason, prompt_tokens=1, completion_tokens=1,
                     stop_sequence=stop_sequence)

    assert build_message(reply(["hi"], "stop"), model="m")["stop_reason"] == "end_turn"
    assert build_message(reply(["hi"], "length"), model="m")["stop_reason"] == "max_tokens"
    stopped = build_message(reply(["hi"], "stop", "##"), model="m")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "##")
    # An empty answer still has its text block (agents read content[0].text); a bare call has none.
    assert build_message(reply([], "stop"), model="m")["content"] == [{"type": "text", "text": ""}]
    call = ToolCall(id="call_1", name="f", arguments="{}")
    assert [b["type"] for b in build_message(reply([call], "tool_calls"), model="m")["content"]] == ["tool_use"]
    # Text after a call keeps its place.
    blocks = build_message(reply(["a", call, "b"], "tool_calls"), model="m")["content"]
    assert [(b["type"], b.get("text")) for b in blocks] == [("text", "a"), ("tool_use", None), ("text", "b")]


# -- the SDK against the route, with a scripted engine: the tool_use paths --------------------


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from transformers import AutoTokenizer

    server = ScriptedEndpoint(AutoTokenizer.from_pretrained(tiny_model_dir))
    yield server
    server.close()


CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+5"}}\n</tool_call>'


def test_sdk_reads_streamed_and_plain_tool_use_from_the_route(scripted):
    session = scripted.open_session()
    scripted.engine.play(Script(["Let me ", "compute.\n", CALL_TEXT]), Script(["Let me compute.\n" + CALL_TEXT]))

    async def main():
        async with anthropic.AsyncAnthropic(base_url=session.session_url, api_key=session.api_key,
                                            max_retries=0) as client:
            request = dict(model="any", max_tokens=64, messages=TOOL_HISTORY, tools=[CALCULATOR])
            async with client.messages.stream(**request) as stream:
                texts = [text async for text in stream.text_stream]
                final = await stream.get_final_message()
            return texts, final, await client.messages.create(**request)

    texts, final, plain = asyncio.run(main())
    scripted.endpoint.close_session(session)
    # Text streams as it comes (trailing whitespace waits to see whether a call follows).
    assert texts == ["Let me", " compute."]
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me compute."
    assert final.content[1].input == {"expression": "3+5"} and final.content[1].name == "calculator"
    assert final.stop_reason == "tool_use" and final.model == "scripted"
    assert final.usage.input_tokens == plain.usage.input_tokens > 0
    assert plain.content[1].input == {"expression": "3+5"} and plain.stop_reason == "tool_use"
    rendered = scripted.endpoint.tokenizer.decode(scripted.engine.requests[-1]["token_ids"])
    assert "<tool_response>\n8\n</tool_response>" in rendered and '"calculator"' in rendered


def test_sdk_gets_errors_before_and_during_a_stream(scripted):
    session = scripted.open_session(max_length=64)
    scripted.engine.play(Script(["partial", ""], finish_reason="abort"))
    client = anthropic.Anthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="m", max_tokens=8, stream=True,
                               messages=[{"role": "user", "content": "word " * 100}])
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert raised.value.body["error"]["message"].startswith("prompt is too long: ")
    stream = client.messages.create(model="m", max_tokens=8, stream=True, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.APIStatusError, match="generation ended with 'abort'"):
        for _ in stream:
            pass
    scripted.endpoint.close_session(session)


# -- the real endpoint and engine -------------------------------------------------------------


@pytest.fixture
def session(endpoint):
    opened = endpoint.open_session(max_tokens=8)
    yield opened
    endpoint.close_session(opened)


def _client(session) -> anthropic.Anthropic:
    # No retries: a test must see the first answer.
    return anthropic.Anthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)


def _action_token_count(session) -> int:
    return sum(sum(segment.action_mask) for segment in session.all_segments())


def test_create_returns_a_message_with_usage_that_matches_the_capture(session):
    with _client(session) as client:
        message = client.messages.create(model=session.model_name, max_tokens=8,
                                         messages=[{"role": "user", "content": "What is 2+3?"}])
    assert message.type == "message" and message.role == "assistant" and message.model == session.model_name
    assert message.id.startswith("msg_")
    assert message.content[0].type == "text" and isinstance(message.content[0].text, str)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    (segment,) = session.all_segments()
    assert message.usage.output_tokens == sum(segment.action_mask) >= 1
    assert message.usage.input_tokens == len(segment.token_ids) - sum(segment.action_mask) > 0


def test_max_tokens_truncation_reports_max_tokens(session):
    with _client(session) as client:
        message = client.messages.create(model=session.model_name, max_tokens=3,
                                         messages=[{"role": "user", "content": "Count to one hundred."}])
    # The random tiny model ends a turn on its own with negligible probability within 3 tokens.
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3 == _action_token_count(session)


def test_stream_true_yields_the_raw_events_in_order(session):
    with _client(session) as client:
        events = list(client.messages.create(model=session.model_name, max_tokens=6, stream=True,
                                             messages=[{"role": "user", "content": "Say something."}]))
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) <= {"content_block_delta"}
    start, block_start, delta = events[0], events[1], events[-2]
    assert start.message.model == session.model_name and start.message.content == []
    assert block_start.content_block.type == "text" and block_start.index == 0
    assert all(event.delta.type == "text_delta" for event in events[2:-3])
    assert delta.delta.stop_reason in ("end_turn", "max_tokens")
    (segment,) = session.all_segments()
    assert delta.usage.output_tokens == sum(segment.action_mask)
    assert delta.usage.input_tokens == len(segment.token_ids) - sum(segment.action_mask)


def test_stream_helper_sync_text_stream_and_final_message(session):
    with _client(session) as client:
        with client.messages.stream(model=session.model_name, max_tokens=6,
                                    messages=[{"role": "user", "content": "Tell me a story."}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens == _action_token_count(session) and final.usage.input_tokens > 0


def test_stream_helper_async(session):
    async def main():
        async with anthropic.AsyncAnthropic(base_url=session.session_url, api_key=session.api_key,
                                            max_retries=0) as client:
            async with client.messages.stream(model=session.model_name, max_tokens=6, system="Be brief.",
                                              messages=[{"role": "user", "content": "Hello"}]) as stream:
                text = "".join([chunk async for chunk in stream.text_stream])
                return text, await stream.get_final_message()

    text, final = asyncio.run(main())
    assert final.content[0].text == text and final.usage.output_tokens == _action_token_count(session)


def test_async_create_with_a_tool_use_history_renders_tools_and_results(endpoint, session):
    async def main():
        async with anthropic.AsyncAnthropic(base_url=session.session_url, api_key=session.api_key,
                                            max_retries=0) as client:
            return await client.messages.create(model=session.model_name, max_tokens=4, messages=TOOL_HISTORY,
                                                tools=[CALCULATOR], extra_body={"temperature": 0.7})

    message = asyncio.run(main())
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    (segment,) = session.all_segments()
    rendered = endpoint.endpoint.tokenizer.decode(segment.token_ids)
    # The tool's schema, the earlier call and its result all reached the chat template.
    assert '"calculator"' in rendered and "3+5" in rendered and "Now answer." in rendered
    assert "<tool_response>\n8\n</tool_response>" in rendered


def _raw_post(client: anthropic.Anthropic, body) -> Message:
    """POST a body the typed `messages.create` would refuse to build (bytes or a dict)."""
    if isinstance(body, bytes):
        return client.post("/v1/messages", cast_to=Message, content=body,
                           options={"headers": {"Content-Type": "application/json"}})
    return client.post("/v1/messages", cast_to=Message, body=body)


@pytest.mark.parametrize("case", [*BAD_BODIES, "malformed JSON", "not an object", "image via create"])
def test_bad_input_is_a_400_the_sdk_raises_and_the_session_goes_on(session, case):
    with _client(session) as client:
        with pytest.raises(anthropic.BadRequestError) as raised:
            if case == "malformed JSON":
                _raw_post(client, b'{"model": "m", "max_tokens": 8, "messages": [')
            elif case == "not an object":
                _raw_post(client, b"[1, 2]")
            elif case == "image via create":
                client.messages.create(model="m", max_tokens=8, stream=True,
                                       messages=BAD_BODIES["image block"][0]["messages"])
            else:
                _raw_post(client, BAD_BODIES[case][0])
        error = raised.value.body
        assert raised.value.status_code == 400 and error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        expected = {"malformed JSON": "request body is not valid JSON", "not an object": "must be a JSON object",
                    "image via create": "image blocks are accepted in user turns"}.get(case) or BAD_BODIES[case][1]
        assert expected in error["error"]["message"]
        assert session.all_segments() == []
        message = client.messages.create(model=session.model_name, max_tokens=2,
                                         messages=[{"role": "user", "content": "still there?"}])
    assert message.usage.output_tokens == _action_token_count(session) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow_is_a_400_in_anthropic_shape(endpoint, stream):
    session = endpoint.open_session(max_tokens=8, max_length=64)
    try:
        with _client(session) as client, pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(model=session.model_name, max_tokens=8, stream=stream,
                                   messages=[{"role": "user", "content": "word " * 200}])
        assert raised.value.body["error"]["type"] == "invalid_request_error"
        assert raised.value.body["error"]["message"].startswith("prompt is too long: ")
        assert session.context_exhausted
    finally:
        endpoint.close_session(session)


def test_wrong_key_is_an_authentication_error(session):
    client = anthropic.Anthropic(base_url=session.session_url, api_key="wrong", max_retries=0)
    with client, pytest.raises(anthropic.AuthenticationError) as raised:
        client.messages.create(model=session.model_name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["error"]["type"] == "authentication_error"
    assert json.dumps(raised.value.body).find(session.api_key) < 0
