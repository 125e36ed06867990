"""The OpenAI Chat Completions route, driven by the real OpenAI SDK (sync and async).

Two servers: the real session endpoint over the shared real vLLM CPU engine (the `endpoint`
fixture), and a small aiohttp app whose scripted session returns tool calls, which the tiny
random model will not produce on its own, so the tool-call wire format is checked through the SDK.
"""

import asyncio
import json
import string
import threading

import httpx
import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletion

from molt.endpoint.openai_api import build_chat_completion, handle_chat_completions
from molt.endpoint.session import Reply, RequestError
from molt.endpoint.tool_calls import ToolCall

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Add.",
    "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}
USER_TURN = [{"role": "user", "content": "3+5="}]


def sdk_client(session) -> OpenAI:
    return OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, timeout=120)


def async_sdk_client(session) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0, timeout=120)


@pytest.fixture
def session(endpoint):
    opened = endpoint.open_session(max_tokens=12, temperature=1.0)
    yield opened
    endpoint.close_session(opened)


def prompt_token_count(engine, messages, tools=None) -> int:
    tokenizer = engine.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# -- the real endpoint and engine ---------------------------------------------------------------


def test_non_streaming_completion_and_usage(session, engine):
    completion = sdk_client(session).chat.completions.create(model=session.model_name, messages=USER_TURN,
                                                             max_tokens=8, seed=1)
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == session.model_name
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens == prompt_token_count(engine, USER_TURN)
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_max_tokens_truncation_gives_length(session):
    client = sdk_client(session)
    for field in ("max_tokens", "max_completion_tokens"):
        completion = client.chat.completions.create(model=session.model_name, seed=3,
                                                    messages=[{"role": "user", "content": f"{field}: 1+1="}],
                                                    **{field: 3})
        assert completion.choices[0].finish_reason == "length", field
        assert completion.usage.completion_tokens == 3, field


def test_streaming_matches_non_streaming(endpoint, engine):
    """Same seed, separate sessions: the streamed deltas add up to the non-streamed reply."""
    plain_session = endpoint.open_session(max_tokens=12)
    streamed_session = endpoint.open_session(max_tokens=12)
    messages = [{"role": "user", "content": "2+2="}]
    plain = sdk_client(plain_session).chat.completions.create(model="m", messages=messages, seed=5)
    chunks = list(sdk_client(streamed_session).chat.completions.create(
        model="m", messages=messages, seed=5, stream=True, stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert content == plain.choices[0].message.content
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(chunk.usage is None for chunk in chunks[:-1])
    for opened in (plain_session, streamed_session):
        endpoint.close_session(opened)


def test_stream_helper_final_completion(session):
    # Stopping at any printable character makes the random model end with finish_reason "stop".
    client = sdk_client(session)
    with client.chat.completions.stream(model="m", messages=USER_TURN, max_tokens=12, seed=2,
                                        stop=list(string.printable), stream_options={"include_usage": True}) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = "".join(event.delta for event in events if event.type == "content.delta")
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == deltas
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens


def test_stream_helper_raises_on_truncation_with_the_completion(session):
    """The SDK's helper refuses to 'parse' a reply cut at max_tokens, as with OpenAI itself;
    the truncated completion rides on the error."""
    client = sdk_client(session)
    with client.chat.completions.stream(model="m", messages=USER_TURN, max_tokens=6, seed=2) as stream:
        events = list(stream)
        with pytest.raises(openai.LengthFinishReasonError) as caught:
            stream.get_final_completion()
    deltas = "".join(event.delta for event in events if event.type == "content.delta")
    truncated = caught.value.completion
    assert truncated.choices[0].message.content == deltas and truncated.choices[0].finish_reason == "length"


def test_async_client_streaming_and_helper(endpoint):
    async def converse(session):
        client = async_sdk_client(session)
        first = await client.chat.completions.create(model="m", messages=USER_TURN, max_tokens=5, seed=4)
        history = USER_TURN + [{"role": "assistant", "content": first.choices[0].message.content},
                               {"role": "user", "content": "and 1+1="}]
        stream = await client.chat.completions.create(model="m", messages=history, max_tokens=5, stream=True)
        streamed = [chunk async for chunk in stream]
        async with client.chat.completions.stream(model="m", messages=USER_TURN, max_tokens=5,
                                                  stop=list(string.printable)) as helper:
            final = await helper.get_final_completion()
        await client.close()
        return first, streamed, final

    session = endpoint.open_session(max_tokens=12)
    first, streamed, final = asyncio.run(converse(session))
    assert first.usage.completion_tokens <= 5
    assert streamed[0].choices[0].delta.role == "assistant"
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].finish_reason == "stop" and final.usage is None
    endpoint.close_session(session)


def test_history_with_tool_calls_and_results_is_accepted(session, engine):
    history = USER_TURN + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "3+5"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "8"}]
    client = sdk_client(session)
    completion = client.chat.completions.create(model="m", messages=history, tools=[CALC_TOOL], max_tokens=4)
    assert completion.usage.prompt_tokens == prompt_token_count(engine, history, [CALC_TOOL])
    # tool_choice="none" withholds the tools from the template: a shorter prompt.
    without_tools = client.chat.completions.create(model="m", messages=history, tools=[CALC_TOOL],
                                                   tool_choice="none", max_tokens=4)
    assert without_tools.usage.prompt_tokens == prompt_token_count(engine, history)
    streamed = list(client.chat.completions.create(model="m", messages=history, tools=[CALC_TOOL],
                                                   max_tokens=4, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_models_list(session):
    models = sdk_client(session).models.list()
    assert [model.id for model in models.data] == [session.model_name]
    assert models.data[0].owned_by == "molt"


BAD_REQUESTS = [
    ("malformed_json", {"content": b'{"model": "m", "messages": [', "headers": {"Content-Type": "application/json"}},
     "not valid JSON"),
    ("not_an_object", {"body": [1, 2]}, "must be a JSON object, got array"),
    ("missing_messages", {"body": {"model": "m"}}, "'messages' is required"),
    ("messages_not_a_list", {"body": {"model": "m", "messages": "hi"}}, "'messages' must be a list"),
    ("empty_messages", {"body": {"model": "m", "messages": []}}, "non-empty"),
    ("unknown_role", {"body": {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}}, "'wizard'"),
    ("content_wrong_type", {"body": {"model": "m", "messages": [{"role": "user", "content": 5}]}}, "content"),
    ("max_tokens_string", {"body": {"model": "m", "messages": USER_TURN, "max_tokens": "ten"}},
     "'max_tokens' must be an integer"),
    ("temperature_string", {"body": {"model": "m", "messages": USER_TURN, "temperature": "hot"}},
     "'temperature' must be a number"),
    ("negative_temperature", {"body": {"model": "m", "messages": USER_TURN, "temperature": -1}}, "temperature=-1"),
    ("stream_not_bool", {"body": {"model": "m", "messages": USER_TURN, "stream": "yes"}}, "'stream' must be a boolean"),
    ("stop_wrong_type", {"body": {"model": "m", "messages": USER_TURN, "stop": [1]}}, "'stop' must be a string"),
    ("tools_not_functions", {"body": {"model": "m", "messages": USER_TURN, "tools": [{"type": "web"}]}}, "tools[0]"),
    ("tool_choice_required", {"body": {"model": "m", "messages": USER_TURN, "tool_choice": "required"}},
     "tool_choice"),
    ("two_choices", {"body": {"model": "m", "messages": USER_TURN, "n": 2}}, "n=2 is not supported"),
]


@pytest.mark.parametrize("name, request_args, message", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_are_400_in_openai_shape_and_the_session_survives(session, name, request_args, message):
    client = sdk_client(session)
    options = {"headers": request_args.pop("headers")} if "headers" in request_args else {}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/chat/completions", cast_to=ChatCompletion, options=options, **request_args)
    error = caught.value
    assert error.status_code == 400
    assert set(error.body) == {"message", "type", "param", "code"}
    assert error.type == "invalid_request_error"
    assert message in error.body["message"]
    completion = client.chat.completions.create(model="m", messages=USER_TURN, max_tokens=2)
    assert completion.usage.completion_tokens <= 2


def test_sdk_typed_errors_for_n_and_empty_messages(session):
    """The same errors through the SDK's own create() call, streaming and not."""
    client = sdk_client(session)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
            client.chat.completions.create(model="m", messages=USER_TURN, n=2, stream=stream)
        with pytest.raises(openai.BadRequestError, match="non-empty"):
            client.chat.completions.create(model="m", messages=[], stream=stream)
    assert client.chat.completions.create(model="m", messages=USER_TURN, max_tokens=2).choices


# -- tool calls and the wire format, with a scripted session ----------------------------------


class ScriptedSession:
    """Stands in for a Session: yields the scripted deltas and reply (or raises the error)."""

    model_name = "scripted"
    session_id = "scripted"

    def __init__(self, items: list):
        self.items = items
        self.requests = []

    async def stream(self, messages, tools, sampling):
        self.requests.append((messages, tools, sampling))
        for item in self.items:
            if isinstance(item, Exception):
                raise item
            yield item

    async def complete(self, messages, tools, sampling):
        async for item in self.stream(messages, tools, sampling):
            if isinstance(item, Reply):
                return item


class ScriptedServer:
    """An aiohttp app on its own loop thread routing /s/<name>/v1/chat/completions to scripted sessions."""

    def __init__(self):
        self.sessions: dict[str, ScriptedSession] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> int:
        async def route(request):
            return await handle_chat_completions(request, self.sessions[request.match_info["name"]])

        app = web.Application()
        app.router.add_post("/s/{name}/v1/chat/completions", route)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def add(self, name: str, items: list) -> str:
        self.sessions[name] = ScriptedSession(items)
        return f"http://127.0.0.1:{self.port}/s/{name}/v1"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedServer()
    yield server
    server.close()


def tool_reply(content: str = "") -> Reply:
    return Reply(content=content, finish_reason="tool_calls", prompt_tokens=20, completion_tokens=30, tool_calls=[
        ToolCall(id="call_a1", name="calc", arguments='{"e": "3+5"}'),
        ToolCall(id="call_b2", name="calc", arguments='{"e": "é+1"}')])


def test_response_builder_with_tool_calls_parses_as_the_sdk_type():
    body = build_chat_completion(tool_reply(), model="m", completion_id="chatcmpl-x", created=7)
    completion = ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content is None and completion.choices[0].finish_reason == "tool_calls"
    assert [(call.id, call.type, call.function.name, json.loads(call.function.arguments))
            for call in message.tool_calls] == [("call_a1", "function", "calc", {"e": "3+5"}),
                                                ("call_b2", "function", "calc", {"e": "é+1"})]
    assert completion.usage.total_tokens == 50
    assert build_chat_completion(tool_reply("Let me see."), model="m")["choices"][0]["message"]["content"] == \
        "Let me see."


def test_tool_calls_through_the_sdk_non_streaming(scripted):
    client = OpenAI(base_url=scripted.add("tools_plain", [tool_reply()]), api_key="k", max_retries=0)
    completion = client.chat.completions.create(model="m", messages=USER_TURN, tools=[CALC_TOOL], temperature=0.5,
                                                top_p=0.9, stop="\n", seed=11, max_completion_tokens=20)
    message = completion.choices[0].message
    assert message.content is None
    assert [call.function.name for call in message.tool_calls] == ["calc", "calc"]
    messages, tools, sampling = scripted.sessions["tools_plain"].requests[0]
    assert messages == USER_TURN and tools == [CALC_TOOL]
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.stop, sampling.seed) == \
        (20, 0.5, 0.9, ["\n"], 11)


def test_tool_calls_through_the_stream_helper(scripted):
    base_url = scripted.add("tools_stream", ["Let me ", "check.", tool_reply("Let me check.")])
    client = OpenAI(base_url=base_url, api_key="k", max_retries=0)
    with client.chat.completions.stream(model="m", messages=USER_TURN, tools=[CALC_TOOL],
                                        stream_options={"include_usage": True}) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    types = [event.type for event in events if event.type != "chunk"]
    # The SDK closes a part when the next one starts: its done event follows the next part's delta.
    assert types == ["content.delta", "content.delta", "tool_calls.function.arguments.delta", "content.done",
                     "tool_calls.function.arguments.delta", "tool_calls.function.arguments.done",
                     "tool_calls.function.arguments.done"]
    done = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert [(event.index, event.name, event.arguments) for event in done] == \
        [(0, "calc", '{"e": "3+5"}'), (1, "calc", '{"e": "é+1"}')]
    message = final.choices[0].message
    assert message.content == "Let me check." and final.choices[0].finish_reason == "tool_calls"
    assert [call.id for call in message.tool_calls] == ["call_a1", "call_b2"]
    assert final.usage.total_tokens == 50


def test_streamed_tool_only_reply_has_null_content_like_the_plain_one(scripted):
    client = OpenAI(base_url=scripted.add("tools_only", [tool_reply()]), api_key="k", max_retries=0)
    chunks = list(client.chat.completions.create(model="m", messages=USER_TURN, tools=[CALC_TOOL], stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [(call.index, call.id, call.function.name) for call in calls] == [(0, "call_a1", "calc"),
                                                                             (1, "call_b2", "calc")]
    with client.chat.completions.stream(model="m", messages=USER_TURN, tools=[CALC_TOOL]) as stream:
        assert stream.get_final_completion().choices[0].message.content is None


def test_content_the_deltas_held_back_arrives_before_the_end(scripted):
    """A botched tool-call block is held back while streaming but is part of the reply's content."""
    content = "Hi <tool_call>{oops</tool_call>"
    base_url = scripted.add("held_back", ["Hi ", Reply(content=content, tool_calls=[], finish_reason="stop",
                                                       prompt_tokens=3, completion_tokens=9)])
    client = OpenAI(base_url=base_url, api_key="k", max_retries=0)
    with client.chat.completions.stream(model="m", messages=USER_TURN) as stream:
        assert stream.get_final_completion().choices[0].message.content == content


def test_sse_wire_format(scripted):
    base_url = scripted.add("wire", ["a", "b", Reply(content="ab", tool_calls=[], finish_reason="length",
                                                     prompt_tokens=2, completion_tokens=2)])
    response = httpx.post(f"{base_url}/chat/completions", json={"messages": USER_TURN, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: {") for event in events[:-2])
    assert [chunk["choices"][0]["delta"] for chunk in chunks] == [
        {"role": "assistant", "content": "a"}, {"content": "b"}, {}]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, "length"]
    assert all("usage" not in chunk for chunk in chunks)


def test_errors_before_and_during_a_stream(scripted):
    early = scripted.add("early_error", [RequestError(400, "messages[0].role='x' is not valid")])
    with pytest.raises(openai.BadRequestError, match="is not valid"):
        list(OpenAI(base_url=early, api_key="k", max_retries=0).chat.completions.create(
            model="m", messages=USER_TURN, stream=True))
    late = scripted.add("late_error", ["partial", RequestError(503, "generation ended with 'abort'", "api_error")])
    stream = OpenAI(base_url=late, api_key="k", max_retries=0).chat.completions.create(
        model="m", messages=USER_TURN, stream=True)
    with pytest.raises(openai.APIError, match="abort"):
        list(stream)
    broken = scripted.add("broken", [RuntimeError("engine exploded")])
    with pytest.raises(openai.InternalServerError) as caught:
        OpenAI(base_url=broken, api_key="k", max_retries=0).chat.completions.create(model="m", messages=USER_TURN)
    assert caught.value.body["type"] == "api_error"
