"""The OpenAI Responses route (`POST /v1/responses`), driven by the real OpenAI SDK and the OpenAI
Agents SDK.

Two servers: the real session endpoint over the shared real vLLM CPU engine (the `endpoint`
fixture; those tests are marked e2e), and a small aiohttp app serving the route over a scripted
session, since the tiny random model never writes tool calls: there the function_call output
path, errors and the Agents SDK's tool loop are checked through the SDKs.
"""

import asyncio
import contextlib
import json
import string
import threading
from types import SimpleNamespace

import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI, OpenAI
from openai.types.responses import Response

from molt.agents.base import SamplingParams
from molt.endpoint.errors import RequestError
from molt.endpoint.messages import Reply, Started, ToolCall, reply_message
from molt.endpoint.openai_chat import CHAT_COMPLETIONS
from molt.endpoint.openai_responses import (MAX_STORED_RESPONSES, RESPONSES, build_response, handle_responses,
                                            remember_response)
from molt.endpoint.tool_calls import merged_parts

e2e = pytest.mark.e2e

CALC_TOOL = {"type": "function", "name": "calc", "description": "Evaluate an arithmetic expression.",
             "parameters": {"type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]},
             "strict": False}
CALC_TOOL_NESTED = {"type": "function", "function": {key: CALC_TOOL[key] for key in ("name", "description",
                                                                                      "parameters")}}
INSTRUCTIONS = "You are a careful calculator."
NOW_TOOL = {"type": "function", "name": "now", "description": "The time of day.",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
CALL_A = ToolCall(id="call_a1", name="calc", arguments='{"e": "3+5"}')
CALL_B = ToolCall(id="call_b2", name="calc", arguments='{"e": "é+1"}')


def sdk_client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


def async_sdk_client(base_url: str, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


def fake_session() -> SimpleNamespace:
    """What the translator reads of a Session, for parsing and building without a server."""
    return SimpleNamespace(api_state={}, default_sampling=SamplingParams(max_tokens=16), model_name="m")


def dump(model, dropped: tuple[str, ...] = ("parsed", "parsed_arguments")) -> dict:
    """A model as plain JSON without the `dropped` keys anywhere (the stream helper adds the parsed ones)."""
    def strip(value):
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items() if key not in dropped}
        if isinstance(value, list):
            return [strip(item) for item in value]
        return value

    return strip(model.model_dump(mode="json"))


def shape(response) -> dict:
    """A response without what differs between two responses to one reply: ids and times."""
    return dump(response, ("id", "created_at", "completed_at", "parsed", "parsed_arguments"))


def expected_event_types(response) -> list[str]:
    """The event types a stream of `response` must send, a run of text deltas counted once."""
    types = ["response.created", "response.in_progress"]
    for item in response.output:
        types.append("response.output_item.added")
        if item.type == "message":
            types.append("response.content_part.added")
            types += ["response.output_text.delta"] if item.content[0].text else []
            types += ["response.output_text.done", "response.content_part.done"]
        else:
            types += ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
        types.append("response.output_item.done")
    return types + [f"response.{response.status}"]


def check_event_stream(events: list) -> Response:
    """The events are in order, numbered, and point at the items of the final response."""
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    types = [event.type for event in events]
    runs = [kind for index, kind in enumerate(types) if index == 0 or kind != types[index - 1]]
    assert runs == expected_event_types(final)
    for event in events:
        if hasattr(event, "item_id"):
            assert final.output[event.output_index].id == event.item_id, event
        if event.type == "response.output_item.done":
            assert dump(event.item) == dump(final.output[event.output_index])
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    return final


# -- request conversion (no server) -------------------------------------------------------------


def test_string_input_and_instructions():
    chat = RESPONSES.parse({"model": "m", "input": "3+5=", "instructions": INSTRUCTIONS}, fake_session())
    assert chat.messages == [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "3+5="}]
    assert chat.tools is None and chat.tool_choice.mode == "auto" and not chat.stream


def test_items_normalize_like_the_same_chat_completions_conversation():
    """Every item form, and the assistant run [text, call, text, call] of one reply, which is one
    assistant turn in chat completions."""
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "3+5 and é+1?"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me ", "annotations": []}]},
             {"type": "function_call", "id": "fc_a1", "call_id": "call_a1", "name": "calc",
              "arguments": '{"e": "3+5"}', "status": "completed"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "check."}]},
             {"type": "function_call", "call_id": "call_b2", "name": "calc", "arguments": '{"e": "é+1"}'},
             {"type": "function_call_output", "call_id": "call_a1", "output": "8"},
             {"type": "function_call_output", "call_id": "call_b2", "output": [{"type": "input_text", "text": "?"}]}]
    chat = RESPONSES.parse({"input": items, "instructions": INSTRUCTIONS, "tools": [CALC_TOOL],
                            "tool_choice": {"type": "function", "name": "calc"}}, fake_session())
    same = CHAT_COMPLETIONS.parse({"messages": [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "3+5 and é+1?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_a1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "3+5"}'}},
            {"id": "call_b2", "type": "function", "function": {"name": "calc", "arguments": '{"e": "é+1"}'}}]},
        {"role": "tool", "tool_call_id": "call_a1", "content": "8"},
        {"role": "tool", "tool_call_id": "call_b2", "content": "?"}],
        "tools": [CALC_TOOL_NESTED], "tool_choice": {"type": "function", "function": {"name": "calc"}}},
        fake_session())
    assert chat.messages == same.messages
    assert chat.tools == same.tools and chat.tool_choice == same.tool_choice


def test_a_function_call_without_text_is_an_assistant_turn_with_empty_content():
    chat = RESPONSES.parse({"input": [{"role": "user", "content": "hi"},
                                      {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
                           fake_session())
    assert chat.messages[-1] == {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}


def test_sampling_and_format_fields():
    chat = RESPONSES.parse({"input": "x", "max_output_tokens": 7, "temperature": 0.7, "top_p": 1,
                            "text": {"format": {"type": "json_schema", "name": "answer", "strict": True,
                                                "schema": {"type": "object"}}},
                            "stream": True, "seed": 3, "stop": ["\n"], "reasoning": {"effort": "low"},
                            "include": ["reasoning.encrypted_content"], "truncation": "auto",
                            "metadata": {"run": "1"}, "user": "u", "parallel_tool_calls": False}, fake_session())
    assert (chat.sampling.max_tokens, chat.sampling.temperature, chat.sampling.seed, chat.sampling.stop) == \
        (7, 0.7, 3, ("\n",))
    assert chat.response_format.kind == "json_schema" and chat.response_format.schema == {"type": "object"}
    assert chat.stream
    json_object = RESPONSES.parse({"input": "x", "text": {"format": {"type": "json_object"}}}, fake_session())
    assert json_object.response_format.kind == "json_object"
    assert RESPONSES.parse({"input": "x", "text": {"format": {"type": "text"}}}, fake_session()).response_format is None


def test_previous_response_id_expands_to_the_stored_conversation_with_the_new_instructions():
    session = fake_session()
    first = RESPONSES.parse({"input": "3+5=", "instructions": "old", "tools": [CALC_TOOL]}, session)
    reply = Reply(parts=["Let me check.", CALL_A], finish_reason="tool_calls", prompt_tokens=10, completion_tokens=5)
    response_id = RESPONSES.build(reply, first, session)["id"]
    follow_up = {"previous_response_id": response_id, "instructions": "new", "tools": [CALC_TOOL],
                 "input": [{"type": "function_call_output", "call_id": "call_a1", "output": "8"}]}
    chat = RESPONSES.parse(follow_up, session)
    # As OpenAI: the previous response's instructions are not carried over.
    assert chat.messages == [{"role": "system", "content": "new"}, {"role": "user", "content": "3+5="},
                             reply_message(reply), {"role": "tool", "content": "8"}]
    # A follow-up of the follow-up sees all of it.
    second = RESPONSES.build(Reply(parts=["8."], finish_reason="stop", prompt_tokens=20, completion_tokens=2),
                             chat, session)
    third = RESPONSES.parse({"previous_response_id": second["id"], "input": "thanks"}, session)
    assert third.messages[:-2] == chat.messages[1:] and third.messages[-1] == {"role": "user", "content": "thanks"}


def test_stored_responses_are_bounded_and_store_false_is_not_kept():
    session = fake_session()
    reply = Reply(parts=["a"], finish_reason="stop", prompt_tokens=1, completion_tokens=1)
    chat = RESPONSES.parse({"input": "x"}, session)
    for index in range(MAX_STORED_RESPONSES + 1):
        remember_response(session, f"resp_{index}", chat, reply)
    assert len(session.api_state["responses"]) == MAX_STORED_RESPONSES
    assert "resp_0" not in session.api_state["responses"] and f"resp_{MAX_STORED_RESPONSES}" in \
        session.api_state["responses"]
    unstored = RESPONSES.build(reply, RESPONSES.parse({"input": "x", "store": False}, session), session)
    with pytest.raises(RequestError, match="store=false") as error:
        RESPONSES.parse({"input": "y", "previous_response_id": unstored["id"]}, session)
    assert error.value.param == "previous_response_id"


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "resp_nope"),
    ({"input": "x", "tools": [CALC_TOOL, {"type": "web_search"}]}, "tools[1]", "only function tools"),
    ({"input": "x", "top_p": 0.5}, "top_p", "top_p=0.5"),
    ({"input": "x", "temperature": 0}, "temperature", "greedy"),
    ({"input": ["hi", {"role": "user", "content": "x"}]}, "input[0]", "must be an object"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "id": "rs_1", "summary": []}]},
     "input[1]", "reasoning item"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "'tool'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content",
     "input_file"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name", "name"),
    ({"input": [{"type": "function_call_output", "output": "8"}]}, "input[0].call_id", "call_id"),
    ({"input": []}, "input", "at least one"),
    ({}, "input", "required"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "calc"}}, "tool_choice", "not in 'tools'"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format", "grammar"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "conversation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "log-probs"),
    ({"input": "x", "truncation": "middle"}, "truncation", "middle"),
])
def test_bad_requests_name_the_field(body, param, words):
    with pytest.raises(RequestError) as error:
        RESPONSES.parse(body, fake_session())
    assert error.value.status == 400 and error.value.param == param
    assert words in error.value.message


# -- the response object (no server) ------------------------------------------------------------


def test_reply_with_text_and_tool_calls_is_a_valid_sdk_response_in_order():
    chat = RESPONSES.parse({"input": "3+5=", "tools": [CALC_TOOL], "instructions": INSTRUCTIONS}, fake_session())
    reply = Reply(parts=["Let me check.", CALL_A, "And", CALL_B], finish_reason="tool_calls", prompt_tokens=20,
                  completion_tokens=30)
    response = Response.model_validate(build_response(reply, chat, model="m", response_id="resp_x", created_at=7))
    assert [item.type for item in response.output] == ["message", "function_call", "message", "function_call"]
    assert response.output_text == "Let me check.And"
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(call.id, call.call_id, call.name, json.loads(call.arguments), call.status) for call in calls] == \
        [("fc_a1", "call_a1", "calc", {"e": "3+5"}, "completed"), ("fc_b2", "call_b2", "calc", {"e": "é+1"},
                                                                   "completed")]
    message = response.output[0]
    assert (message.role, message.status, message.content[0].annotations) == ("assistant", "completed", [])
    assert (response.status, response.incomplete_details, response.error) == ("completed", None, None)
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (20, 30, 50)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == INSTRUCTIONS and response.tools[0].name == "calc"
    assert (response.tool_choice, response.parallel_tool_calls, response.temperature, response.top_p) == \
        ("auto", True, 1.0, 1.0)
    assert response.text.format.type == "text" and response.model == "m" and response.object == "response"


def test_cut_reply_is_incomplete_and_empty_reply_still_has_a_message():
    chat = RESPONSES.parse({"input": "x", "max_output_tokens": 3}, fake_session())
    cut = Response.model_validate(build_response(Reply(parts=["abc"], finish_reason="length", prompt_tokens=2,
                                                       completion_tokens=3), chat, model="m", response_id="r",
                                                 created_at=0))
    assert (cut.status, cut.incomplete_details.reason, cut.max_output_tokens) == ("incomplete", "max_output_tokens", 3)
    empty = Response.model_validate(build_response(Reply(parts=[], finish_reason="stop", prompt_tokens=2,
                                                         completion_tokens=1), chat, model="m", response_id="r",
                                                   created_at=0))
    assert [item.type for item in empty.output] == ["message"] and empty.output_text == ""


# -- the route over a scripted session ----------------------------------------------------------


def scripted_reply(*pieces, finish_reason: str = "stop", prompt_tokens: int = 20) -> list:
    """A script as a Session streams it: the text pieces and ToolCalls, then the Reply."""
    parts = merged_parts(list(pieces))
    if any(isinstance(part, ToolCall) for part in parts):
        finish_reason = "tool_calls"
    return list(pieces) + [Reply(parts=parts, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
                                 completion_tokens=len(pieces) + 1)]


class ScriptedSession:
    """Stands in for a Session: answers each request with the next script and keeps the
    ChatRequests it got. An exception first in a script is raised before Started (a refused
    request), elsewhere mid-stream."""

    model_name = "scripted"
    session_id = "scripted"
    default_sampling = SamplingParams(max_tokens=16)

    def __init__(self, scripts: list[list]):
        self.scripts = list(scripts)
        self.requests = []
        self.api_state = {}

    async def stream(self, chat, *, incremental: bool = True):
        self.requests.append(chat)
        script = self.scripts.pop(0)
        if isinstance(script[0], Exception):
            raise script[0]
        yield Started(prompt_tokens=20)
        for item in script:
            if isinstance(item, Exception):
                raise item
            if incremental or isinstance(item, Reply):
                yield item

    async def complete(self, chat) -> Reply:
        async for item in self.stream(chat, incremental=False):
            if isinstance(item, Reply):
                return item


class ScriptedServer:
    """An aiohttp app on its own loop thread routing /s/<name>/v1/responses to scripted sessions."""

    def __init__(self):
        self.sessions: dict[str, ScriptedSession] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> int:
        async def route(request):
            return await handle_responses(request, self.sessions[request.match_info["name"]])

        app = web.Application()
        app.router.add_post("/s/{name}/v1/responses", route)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    def add(self, name: str, scripts: list[list]) -> tuple[str, ScriptedSession]:
        self.sessions[name] = ScriptedSession(scripts)
        return f"http://127.0.0.1:{self.port}/s/{name}/v1", self.sessions[name]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedServer()
    yield server
    server.close()


def test_scripted_tool_calls_stream_and_non_stream_agree_through_the_sdk(scripted):
    script = scripted_reply("Let me ", "check.", CALL_A, "And ", "this", CALL_B)
    base_url, session = scripted.add("tools", [script, script, script, scripted_reply("8.")])
    client = sdk_client(base_url, "k")
    request = {"model": "m", "input": "3+5 and é+1?", "tools": [CALC_TOOL]}
    plain = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    streamed = check_event_stream(events)
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    assert shape(streamed) == shape(plain) == shape(final)
    assert [item.type for item in plain.output] == ["message", "function_call", "message", "function_call"]
    assert plain.output_text == "Let me check.And this"
    assert [item.call_id for item in plain.output if item.type == "function_call"] == ["call_a1", "call_b2"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas == ["Let me ", "check.", "And ", "this"]  # as the text arrived
    arguments = [event.arguments for event in events if event.type == "response.function_call_arguments.done"]
    assert arguments == [CALL_A.arguments, CALL_B.arguments]
    # A streamed response is stored too: its follow-up extends its conversation by its reply.
    client.responses.create(model="m", previous_response_id=streamed.id, tools=[CALC_TOOL],
                            input=[{"type": "function_call_output", "call_id": "call_a1", "output": "8"}])
    assert session.requests[-1].messages == session.requests[1].messages + [
        reply_message(script[-1]), {"role": "tool", "content": "8"}]


def test_scripted_async_stream_of_a_tool_only_reply(scripted):
    base_url, _ = scripted.add("tool_only", [scripted_reply(CALL_A)])

    async def run():
        async with async_sdk_client(base_url, "k") as client:
            async with client.responses.stream(model="m", input="3+5?", tools=[CALC_TOOL]) as stream:
                events = [event async for event in stream]
                return events, await stream.get_final_response()

    events, final = asyncio.run(run())
    assert [item.type for item in final.output] == ["function_call"] and final.output_text == ""
    assert final.output[0].arguments == CALL_A.arguments and final.status == "completed"
    assert "response.content_part.added" not in [event.type for event in events]


def test_scripted_empty_and_cut_replies_stream_like_the_plain_ones(scripted):
    for name, script in (("empty", scripted_reply()), ("cut", scripted_reply("abc", finish_reason="length"))):
        base_url, _ = scripted.add(name, [script, script])
        client = sdk_client(base_url, "k")
        plain = client.responses.create(model="m", input="x")
        events = list(client.responses.create(model="m", input="x", stream=True))
        assert shape(check_event_stream(events)) == shape(plain), name
    assert plain.status == "incomplete" and events[-1].type == "response.incomplete"


def test_scripted_errors_before_and_during_a_stream(scripted):
    refused = RequestError(400, "This model's maximum context length is 256 tokens", param="messages",
                           code="context_length_exceeded")
    base_url, _ = scripted.add("errors", [[refused], [refused], ["partial", RequestError(503, "generation ended "
                                                                                              "with 'abort'",
                                                                                         "api_error")],
                                          ["partial", RuntimeError("engine exploded")]])
    client = sdk_client(base_url, "k")
    with pytest.raises(openai.BadRequestError, match="maximum context length") as error:
        client.responses.create(model="m", input="x")
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        list(client.responses.create(model="m", input="x", stream=True))
    for message in ("generation ended with 'abort'", "the endpoint failed mid-stream"):
        events = list(client.responses.create(model="m", input="x", stream=True))
        assert events[-1].type == "error" and message in events[-1].message
        assert events[-1].sequence_number == len(events) - 1
        assert [event.type for event in events][-3:-1] == ["response.content_part.added",
                                                           "response.output_text.delta"]


@pytest.mark.parametrize("stream", [False, True])
def test_scripted_bad_request_is_a_bad_request_error_naming_the_field(scripted, stream):
    base_url, session = scripted.add(f"bad_{stream}", [])
    client = sdk_client(base_url, "k")
    cases = [({"previous_response_id": "resp_missing"}, "previous_response_id"),
             ({"tools": [{"type": "web_search"}]}, "tools[0]"), ({"top_p": 0.5}, "top_p"),
             ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0]")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(**{"model": "m", "input": "x", "stream": stream, **fields})
        assert error.value.param == param and param.split("[")[0] in error.value.message
    assert session.requests == []  # refused before the session saw anything


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_tool_loop_sends_back_a_continuation(scripted, streamed):
    """The Agents SDK's own follow-up (its output items and the tool's result) extends the first
    request's conversation by exactly the reply and the result: one segment in a real session."""
    agents = pytest.importorskip("agents")

    @agents.function_tool
    def calc(e: str) -> str:
        """Evaluate an arithmetic expression."""
        return "8"

    base_url, session = scripted.add(f"agent_{streamed}", [scripted_reply("Let me check.", CALL_A),
                                                           scripted_reply("It is ", "8.")])

    async def run():
        async with async_sdk_client(base_url, "k") as client:
            model = agents.OpenAIResponsesModel(model="m", openai_client=client)
            agent = agents.Agent(name="calc", instructions=INSTRUCTIONS, model=model, tools=[calc])
            config = agents.RunConfig(tracing_disabled=True)
            if not streamed:
                return (await agents.Runner.run(agent, "3+5?", run_config=config)).final_output
            result = agents.Runner.run_streamed(agent, "3+5?", run_config=config)
            async for _ in result.stream_events():
                pass
            return result.final_output

    assert asyncio.run(run()) == "It is 8."
    first, second = session.requests
    reply = Reply(parts=["Let me check.", CALL_A], finish_reason="tool_calls", prompt_tokens=20, completion_tokens=3)
    assert first.messages == [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "3+5?"}]
    assert second.messages == first.messages + [reply_message(reply), {"role": "tool", "content": "8"}]
    assert second.tools == first.tools and first.tools[0]["function"]["name"] == "calc"


# -- the real endpoint and engine ---------------------------------------------------------------


class RecordingEngine:
    """The real engine, plus what it was asked and exactly what it sampled for each request."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[dict] = []

    async def stream(self, prompt_ids, *args, **kwargs):
        call = {"prompt_ids": list(prompt_ids), "token_ids": [], "logprobs": []}
        self.calls.append(call)
        async with contextlib.aclosing(self.engine.stream(prompt_ids, *args, **kwargs)) as deltas:
            async for delta in deltas:
                call["token_ids"] += delta.token_ids
                call["logprobs"] += delta.logprobs
                yield delta


@pytest.fixture
def session(endpoint):
    opened = endpoint.open_session(max_tokens=12, temperature=1.0)
    opened.engine = RecordingEngine(opened.engine)
    yield opened
    endpoint.close_session(opened)


def prompt_token_count(engine, messages, tools=None) -> int:
    tokenizer = engine.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def check_one_segment_of_the_sampled_tokens(session) -> None:
    """Two turns made one segment: the prompts, the sampled ids and their log-probs, in place."""
    assert (session.ledger.counts["first_turn"], session.ledger.counts["continued"]) == (1, 1)
    assert not {"history_rewrite", "template_rewrite", "tools_changed"} & set(session.ledger.counts)
    (segment,) = session.all_segments()
    first, second = session.engine.calls
    assert second["prompt_ids"][:len(first["prompt_ids"]) + len(first["token_ids"])] == \
        first["prompt_ids"] + first["token_ids"]
    assert segment.token_ids == second["prompt_ids"] + second["token_ids"]
    actions = [index for index, is_action in enumerate(segment.action_mask) if is_action]
    first_start, second_start = len(first["prompt_ids"]), len(second["prompt_ids"])
    assert actions == list(range(first_start, first_start + len(first["token_ids"]))) + \
        list(range(second_start, second_start + len(second["token_ids"])))
    assert [segment.token_ids[index] for index in actions] == first["token_ids"] + second["token_ids"]
    assert [segment.logprobs[index] for index in actions] == first["logprobs"] + second["logprobs"]


@e2e
def test_string_input_on_the_real_engine(session, engine):
    response = sdk_client(session.base_url, session.api_key).responses.create(model=session.model_name,
                                                                               input="3+5=", max_output_tokens=8)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == session.model_name
    assert response.status in ("completed", "incomplete") and response.output[0].type == "message"
    (call,) = session.engine.calls
    assert response.usage.input_tokens == len(call["prompt_ids"]) == \
        prompt_token_count(engine, [{"role": "user", "content": "3+5="}])
    assert response.usage.output_tokens == len(call["token_ids"]) <= 8
    assert response.output_text.strip() == engine.engine.tokenizer.decode(call["token_ids"],
                                                                          skip_special_tokens=True).strip()


@e2e
def test_items_with_instructions_render_as_the_chat_conversation(session, engine):
    input_items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                   {"role": "user", "content": "3+5="}]
    response = sdk_client(session.base_url, session.api_key).responses.create(
        model=session.model_name, instructions=INSTRUCTIONS, input=input_items, tools=[CALC_TOOL],
        temperature=0.8, max_output_tokens=4)
    chat_messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "3+5="}]
    assert response.usage.input_tokens == prompt_token_count(engine, chat_messages, [CALC_TOOL_NESTED])
    assert (response.instructions, response.temperature, response.tools[0].name) == (INSTRUCTIONS, 0.8, "calc")
    assert session.all_segments()[0].temperatures[-1] == 0.8


@e2e
def test_second_turn_with_the_whole_history_continues_one_segment(session):
    client = sdk_client(session.base_url, session.api_key)
    turn = {"model": session.model_name, "instructions": INSTRUCTIONS, "tools": [CALC_TOOL]}
    history = [{"role": "user", "content": "3+5="}]
    first = client.responses.create(**turn, input=history)
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history += [{"type": "function_call_output", "call_id": "call_x", "output": "8"}]
    second = client.responses.create(**turn, input=history)
    assert second.status in ("completed", "incomplete")
    check_one_segment_of_the_sampled_tokens(session)


@e2e
def test_second_turn_with_previous_response_id_continues_one_segment(session):
    client = sdk_client(session.base_url, session.api_key)
    turn = {"model": session.model_name, "instructions": INSTRUCTIONS, "tools": [CALC_TOOL]}
    first = client.responses.create(**turn, input="3+5=")
    second = client.responses.create(**turn, previous_response_id=first.id,
                                      input=[{"type": "function_call_output", "call_id": "call_x", "output": "8"}])
    assert second.previous_response_id == first.id
    check_one_segment_of_the_sampled_tokens(session)
    with pytest.raises(openai.BadRequestError, match="resp_unknown") as error:
        client.responses.create(**turn, previous_response_id="resp_unknown", input="more")
    assert error.value.param == "previous_response_id"


@e2e
def test_a_forced_tool_call_and_its_result_continue_one_segment(endpoint):
    """A named tool_choice makes even the random model call the tool (guided decoding), once, and
    the reply ends: the function_call item streams and comes back as input with its result."""
    session = endpoint.open_session(max_tokens=64)
    session.engine = RecordingEngine(session.engine)
    try:
        client = sdk_client(session.base_url, session.api_key)
        turn = {"model": session.model_name, "instructions": INSTRUCTIONS, "tools": [NOW_TOOL]}
        history = [{"role": "user", "content": "What time is it?"}]
        first = check_event_stream(list(client.responses.create(**turn, input=history, stream=True,
                                                                tool_choice={"type": "function", "name": "now"})))
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls and first.status == "completed"
        assert (calls[0].name, json.loads(calls[0].arguments), calls[0].call_id[:5]) == ("now", {}, "call_")
        history += [item.model_dump(exclude_none=True) for item in first.output]
        history += [{"type": "function_call_output", "call_id": call.call_id, "output": "noon"} for call in calls]
        client.responses.create(**turn, input=history, max_output_tokens=4)
        check_one_segment_of_the_sampled_tokens(session)
        context = session.tokenizer.decode([token for token, is_action in zip(session.current.token_ids,
                                                                               session.current.action_mask)
                                            if not is_action])
        assert "noon" in context
    finally:
        endpoint.close_session(session)


@e2e
def test_chat_completions_then_responses_continues_one_segment(session):
    client = sdk_client(session.base_url, session.api_key)
    first = client.chat.completions.create(model=session.model_name, tools=[CALC_TOOL_NESTED], messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "3+5="}])
    client.responses.create(model=session.model_name, instructions=INSTRUCTIONS, tools=[CALC_TOOL], input=[
        {"role": "user", "content": "3+5="}, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and 4+4?"}])
    check_one_segment_of_the_sampled_tokens(session)


@e2e
def test_streamed_and_plain_responses_to_one_reply_are_equal(session):
    """The plain request repeats the streamed one's Idempotency-Key, so it gets the same reply.
    Stop strings (digits, a space: frequent in the tiny model's text) make a completed reply,
    whose final response the stream helper gives, likely; a cut one is checked as well."""
    client = sdk_client(session.base_url, session.api_key)
    request = {"model": session.model_name, "input": "3+5=", "extra_headers": {"Idempotency-Key": "turn-1"},
               "extra_body": {"stop": [*"0123456789", " "], "seed": 1}}
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    plain = client.responses.create(**request)
    assert shape(final) == shape(plain) and final.output_text == plain.output_text
    assert session.ledger.counts == {"first_turn": 1, "retry": 1}
    assert shape(check_event_stream(events)) == shape(plain)
    check_event_stream(list(client.responses.create(model=session.model_name, input="4+4=", stream=True)))


@e2e
def test_async_create_and_stream(session):
    async def run():
        async with async_sdk_client(session.base_url, session.api_key) as client:
            plain = await client.responses.create(model=session.model_name, input="3+5=", max_output_tokens=4)
            async with client.responses.stream(model=session.model_name, max_output_tokens=4,
                                               input=[{"role": "user", "content": "4+4="}]) as stream:
                events = [event async for event in stream]
            return plain, events

    plain, events = asyncio.run(run())
    assert plain.output[0].type == "message"
    assert events[0].type == "response.created" and events[-1].type.startswith("response.")
    assert len(session.all_segments()) == 2  # two unrelated conversations


@e2e
def test_max_output_tokens_makes_an_incomplete_response(session):
    client = sdk_client(session.base_url, session.api_key)
    response = client.responses.create(model=session.model_name, input="1+1=", max_output_tokens=2,
                                       extra_body={"seed": 3})
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.usage.output_tokens == 2
    events = list(client.responses.create(model=session.model_name, input="2+2=", max_output_tokens=2,
                                          extra_body={"seed": 3}, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 2


@e2e
def test_agents_sdk_on_the_real_engine(session):
    agents = pytest.importorskip("agents")

    # The Agents SDK raises on an incomplete response, as OpenAI's: stopping at any printable
    # character ends the random model's reply within its 12 tokens.
    settings = agents.ModelSettings(extra_body={"stop": list(string.printable)})

    async def run():
        async with async_sdk_client(session.base_url, session.api_key) as client:
            model = agents.OpenAIResponsesModel(model=session.model_name, openai_client=client)
            agent = agents.Agent(name="calc", instructions=INSTRUCTIONS, model=model, model_settings=settings)
            result = await agents.Runner.run(agent, "3+5=", run_config=agents.RunConfig(tracing_disabled=True))
            return result.final_output

    assert isinstance(asyncio.run(run()), str)
    assert session.ledger.counts == {"first_turn": 1}
    (call,) = session.engine.calls
    prompt = session.tokenizer.decode(call["prompt_ids"])
    assert prompt.index(INSTRUCTIONS) < prompt.index("3+5=")
