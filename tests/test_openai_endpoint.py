"""The OpenAI Chat Completions route, driven by the real OpenAI SDK (sync and async).

Two servers: the real session endpoint over the shared real vLLM CPU engine (the `endpoint`
fixture), and a small aiohttp app whose scripted session returns tool calls, which the tiny
random model will not produce on its own, so the tool-call wire format is checked through the SDK.
"""

import asyncio
import json
import string

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletion

from molt.endpoint.messages import Reply, ToolCall
from molt.endpoint.openai_chat import build_chat_completion
from scripted_engine import Script, ScriptedEndpoint

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


def test_streamed_deltas_are_the_recorded_reply(endpoint, engine):
    """The streamed content adds up to the text of exactly the tokens the session recorded."""
    session = endpoint.open_session(max_tokens=12)
    chunks = list(sdk_client(session).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+2="}], seed=5, stream=True,
        stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    segment = session.all_segments()[0]
    sampled = [token for token, is_action in zip(segment.token_ids, segment.action_mask) if is_action]
    assert content == engine.engine.tokenizer.decode(sampled, skip_special_tokens=True)
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(sampled)
    assert all(chunk.usage is None for chunk in chunks[:-1])
    endpoint.close_session(session)


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
    # tool_choice="none" keeps the tools in the prompt (the rendering, and so the segment, is unchanged).
    without_calls = client.chat.completions.create(model="m", messages=history, tools=[CALC_TOOL],
                                                   tool_choice="none", max_tokens=4)
    assert without_calls.usage.prompt_tokens == completion.usage.prompt_tokens
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
    ("tool_choice_required_without_tools", {"body": {"model": "m", "messages": USER_TURN, "tool_choice": "required"}},
     "needs at least one tool"),
    ("tool_choice_unknown_function", {"body": {"model": "m", "messages": USER_TURN, "tools": [CALC_TOOL],
                                               "tool_choice": {"type": "function", "function": {"name": "x"}}}},
     "not in 'tools'"),
    ("top_p_below_one", {"body": {"model": "m", "messages": USER_TURN, "top_p": 0.9}}, "top_p=0.9 is not supported"),
    ("top_k", {"body": {"model": "m", "messages": USER_TURN, "top_k": 40}}, "top_k=40 is not supported"),
    ("greedy", {"body": {"model": "m", "messages": USER_TURN, "temperature": 0}}, "temperature=0"),
    ("penalty", {"body": {"model": "m", "messages": USER_TURN, "presence_penalty": 0.5}}, "presence_penalty"),
    ("top_logprobs_without_logprobs", {"body": {"model": "m", "messages": USER_TURN, "top_logprobs": 2}},
     "needs logprobs=true"),
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


# -- tool calls and the wire format, with a scripted engine -------------------------------------


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    from transformers import AutoTokenizer

    server = ScriptedEndpoint(AutoTokenizer.from_pretrained(tiny_model_dir))
    yield server
    server.close()


@pytest.fixture
def scripted_session(scripted):
    opened = scripted.open_session()
    yield opened
    scripted.endpoint.close_session(opened)


def scripted_client(session) -> OpenAI:
    return OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def call_text(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calc", "arguments": {"e": expression}}, ensure_ascii=False) + \
        "\n</tool_call>"


TWO_CALLS = call_text("3+5") + "\n" + call_text("é+1")


def test_response_builder_with_tool_calls_parses_as_the_sdk_type():
    reply = Reply(parts=[ToolCall(id="call_a1", name="calc", arguments='{"e": "3+5"}'),
                         ToolCall(id="call_b2", name="calc", arguments='{"e": "é+1"}')],
                  finish_reason="tool_calls", prompt_tokens=20, completion_tokens=30)
    body = build_chat_completion(reply, model="m", completion_id="chatcmpl-x", created=7)
    completion = ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content is None and completion.choices[0].finish_reason == "tool_calls"
    assert [(call.id, call.type, call.function.name, json.loads(call.function.arguments))
            for call in message.tool_calls] == [("call_a1", "function", "calc", {"e": "3+5"}),
                                                ("call_b2", "function", "calc", {"e": "é+1"})]
    assert completion.usage.total_tokens == 50
    reply.parts.insert(0, "Let me see.")
    assert build_chat_completion(reply, model="m")["choices"][0]["message"]["content"] == "Let me see."


def test_tool_calls_and_sampling_fields_through_the_sdk(scripted, scripted_session):
    scripted.engine.play(Script([TWO_CALLS]))
    completion = scripted_client(scripted_session).chat.completions.create(
        model="m", messages=USER_TURN, tools=[CALC_TOOL], temperature=0.5, top_p=1, stop="\n\n", seed=11,
        max_completion_tokens=20)
    message = completion.choices[0].message
    assert message.content is None and completion.choices[0].finish_reason == "tool_calls"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == \
        [("calc", {"e": "3+5"}), ("calc", {"e": "é+1"})]
    request = scripted.engine.requests[-1]
    assert (request["sampling"].max_tokens, request["sampling"].temperature, request["stop"]) == (20, 0.5, ["\n\n"])
    # The request's seed is mixed with the session's, so sessions of one group sample differently.
    assert request["seed"] is not None and request["seed"] != 11


def test_tool_calls_through_the_stream_helper(scripted, scripted_session):
    scripted.engine.play(Script(["Let me ", "check.\n", TWO_CALLS[:20], TWO_CALLS[20:]]))
    client = scripted_client(scripted_session)
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
    assert [(event.index, event.name, json.loads(event.arguments)) for event in done] == \
        [(0, "calc", {"e": "3+5"}), (1, "calc", {"e": "é+1"})]
    message = final.choices[0].message
    assert message.content == "Let me check." and final.choices[0].finish_reason == "tool_calls"
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens


def test_streamed_tool_only_reply_has_null_content_like_the_plain_one(scripted, scripted_session):
    scripted.engine.play(Script([TWO_CALLS]), Script([TWO_CALLS]))
    client = scripted_client(scripted_session)
    chunks = list(client.chat.completions.create(model="m", messages=USER_TURN, tools=[CALC_TOOL], stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [(call.index, call.function.name) for call in calls] == [(0, "calc"), (1, "calc")]
    with client.chat.completions.stream(model="m", messages=USER_TURN, tools=[CALC_TOOL]) as stream:
        assert stream.get_final_completion().choices[0].message.content is None


def test_sse_wire_format(scripted, scripted_session):
    scripted.engine.play(Script(["a", "b"], finish_reason="length"))
    response = httpx.post(f"{scripted_session.base_url}/chat/completions", json={"messages": USER_TURN, "stream": True},
                          headers={"Authorization": f"Bearer {scripted_session.api_key}"})
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


def test_errors_before_and_during_a_stream(scripted, scripted_session):
    client = scripted_client(scripted_session)
    with pytest.raises(openai.BadRequestError, match="is not one of"):
        list(client.chat.completions.create(model="m", messages=[{"role": "x", "content": "?"}], stream=True))
    scripted.engine.play(Script(["partial", ""], finish_reason="abort"))
    with pytest.raises(openai.APIError, match="abort"):
        list(client.chat.completions.create(model="m", messages=USER_TURN, stream=True))
    scripted.engine.play(Script(["x"], error=RuntimeError("engine exploded")))
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="m", messages=USER_TURN)
    assert caught.value.body["type"] == "api_error"


def test_logprobs_and_top_logprobs(scripted, scripted_session):
    scripted.engine.play(Script(["ab", "c"]), Script(["ab", "c"]))
    client = scripted_client(scripted_session)
    completion = client.chat.completions.create(model="m", messages=USER_TURN, logprobs=True, top_logprobs=1)
    tokens = completion.choices[0].logprobs.content
    assert "".join(token.token for token in tokens) == "abc"
    assert all(token.logprob == -0.5 and len(token.top_logprobs) == 1 for token in tokens)
    assert scripted.engine.requests[-1]["top_logprobs"] == 1
    chunks = list(client.chat.completions.create(model="m", messages=USER_TURN, logprobs=True, stream=True))
    streamed = [token for chunk in chunks for token in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs
                                                        else [])]
    assert [token.token for token in streamed] == [token.token for token in tokens]
    scripted.engine.play(Script(["z"]))
    assert client.chat.completions.create(model="m", messages=USER_TURN).choices[0].logprobs is None


def test_response_format_and_forced_tools_become_engine_constraints(scripted, scripted_session):
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    def accepts(structural_tag: dict, text: str) -> bool:
        return _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(json.dumps(structural_tag)), text)

    client = scripted_client(scripted_session)
    scripted.engine.play(Script(['{"a": 1}']), Script([call_text("1")]), Script([call_text("2")]))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(model="m", messages=USER_TURN, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    # JSON in json.dumps layout only: free whitespace would let a constrained model pad its reply.
    answer = json.loads(scripted.engine.requests[-1]["constraint"]["structural_tag"])
    assert [accepts(answer, text) for text in ('{"a": 1}', '{}', '{"a":1}', '{ "a": 1}', '{"a": "x"}')] == [
        True, True, False, False, False]
    required = client.chat.completions.create(model="m", messages=USER_TURN, tools=[CALC_TOOL], tool_choice="required")
    assert required.choices[0].message.tool_calls[0].function.name == "calc"
    tag = json.loads(scripted.engine.requests[-1]["constraint"]["structural_tag"])
    assert tag["format"]["at_least_one"] and tag["format"]["tags"][0]["begin"].startswith("<tool_call>")
    client.chat.completions.create(model="m", messages=USER_TURN, tools=[CALC_TOOL],
                                   tool_choice={"type": "function", "function": {"name": "calc"}})
    tag = json.loads(scripted.engine.requests[-1]["constraint"]["structural_tag"])
    assert tag["format"]["type"] == "tag" and '"calc"' in tag["format"]["begin"]
    assert accepts(tag, call_text("1")) and not accepts(tag, call_text("1").replace('{"e": ', '{"e":  '))
    assert scripted_session.ledger.counts["constrained"] == 3
