"""The session endpoint's security and failure cases (RELIABILITY 7, 8, 20-23; DESIGN section 4),
against the real aiohttp server on the real vLLM engine, with the official SDKs and raw HTTP."""

import asyncio
import inspect
import itertools
import json
import logging
import pickle
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pytest

from molt.agents import Result, RolloutRequest, SamplingParams
from molt.agents.chat import ChatAgent, ChatAgentRunner
from molt.agents.env import run_with_timeout
from molt.endpoint.server import SessionEndpoint

ROUTES = {  # route -> (method, error shape)
    "chat/completions": ("POST", "openai"),
    "responses": ("POST", "openai"),
    "messages": ("POST", "anthropic"),
    "messages/count_tokens": ("POST", "anthropic"),
    "models": ("GET", "openai"),
}
CHAT_BODY = {"model": "molt-tiny", "messages": [{"role": "user", "content": "3+5="}], "max_tokens": 4}
BODIES = {"responses": {"model": "molt-tiny", "input": "3+5=", "max_output_tokens": 4}}


def _call(url: str, method: str, *, key: str | None = None, body=None, header: str = "bearer",
          content: bytes | None = None, chunked: bool = False) -> httpx.Response:
    """One request; `chunked` sends the body without a Content-Length, in 1 KiB pieces."""
    headers = {}
    if key is not None:
        headers = {"Authorization": f"Bearer {key}".strip()} if header == "bearer" else {"x-api-key": key}
    if body is not None:
        content = json.dumps(body).encode()
    if content is not None:
        headers["Content-Type"] = "application/json"
    if chunked:
        data = content
        content = (data[start:start + 1024] for start in range(0, len(data), 1024))
    with httpx.Client(timeout=60) as client:
        return client.request(method, url, headers=headers, content=content)


def _route_call(base_url: str, route: str, **kwargs) -> httpx.Response:
    method, _ = ROUTES[route]
    body = None if method == "GET" else BODIES.get(route, CHAT_BODY)
    return _call(f"{base_url}/{route}", method, body=body, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind, error
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error", body
    assert body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def assert_error_shape(response: httpx.Response, route: str, status: int, kind: str) -> None:
    if ROUTES[route][1] == "anthropic":
        assert_anthropic_error(response, status, kind)
    else:
        assert_openai_error(response, status, kind)


@pytest.fixture
def two_sessions(endpoint):
    sessions = [endpoint.open_session(max_tokens=4), endpoint.open_session(max_tokens=4)]
    yield sessions
    for session in sessions:
        endpoint.close_session(session)


# -- RELIABILITY 22: loopback, keys, no control routes ------------------------------------------


def test_endpoint_binds_to_loopback_by_default(endpoint):
    assert inspect.signature(SessionEndpoint).parameters["host"].default == "127.0.0.1"
    addresses = endpoint.endpoint._runner.addresses
    assert addresses, "the endpoint is not listening"
    assert all(address[0] == "127.0.0.1" for address in addresses), addresses
    # Not reachable on the machine's other interface (if it has one).
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it picks the outbound interface
        own_address = probe.getsockname()[0]
    except OSError:
        own_address = "127.0.0.1"
    finally:
        probe.close()
    if not own_address.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((own_address, endpoint.endpoint.port), timeout=2).close()


@pytest.mark.parametrize("route", list(ROUTES))
def test_the_sessions_own_key_is_accepted_in_either_header(endpoint, two_sessions, route):
    """The positive control for the 401 cases below."""
    session = two_sessions[0]
    for header in ("bearer", "x-api-key"):
        response = _route_call(session.base_url, route, key=session.api_key, header=header)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("case", ["wrong", "missing", "other_session", "unknown_session", "closed_session",
                                  "empty", "prefix"])
def test_bad_session_keys_get_401_in_the_apis_error_shape(endpoint, two_sessions, route, case):
    session, other = two_sessions
    base_url, key = session.base_url, session.api_key
    if case == "wrong":
        key = "molt-" + "x" * 32
    elif case == "missing":
        key = None
    elif case == "other_session":
        key = other.api_key
    elif case == "unknown_session":
        base_url = f"{endpoint.endpoint.url}/s/{'0' * 16}/v1"
    elif case == "closed_session":
        endpoint.close_session(session)
    elif case == "empty":
        key = ""
    elif case == "prefix":
        key = key[:-1]
    for header in ("bearer", "x-api-key"):
        response = _route_call(base_url, route, key=key, header=header)
        assert_error_shape(response, route, 401, "authentication_error")
    assert session.current is None, "a refused request reached the session"


def test_sdks_raise_authentication_error(endpoint, two_sessions):
    session, other = two_sessions
    client = openai.OpenAI(base_url=session.base_url, api_key=other.api_key, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model="molt-tiny", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401 and caught.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()

    client = anthropic.Anthropic(base_url=session.session_url, api_key="molt-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client.messages.create(model="molt-tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.response.json()["error"]["type"] == "authentication_error"

    # An ended session's own key, through both SDKs.
    endpoint.close_session(session)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0).messages.create(
            model="molt-tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


CONTROL_PATHS = ["/pause", "/resume", "/refit", "/abort", "/admin", "/shutdown", "/v1/refit", "/v1/abort",
                 "/s/{sid}/refit", "/s/{sid}/pause", "/s/{sid}/resume", "/s/{sid}/abort", "/s/{sid}/v1/refit",
                 "/s/{sid}/v1/abort", "/s/{sid}/v1/pause", "/s/{sid}/v1/weights", "/s/{sid}/v1/sessions"]


@pytest.mark.parametrize("path", CONTROL_PATHS)
def test_there_are_no_control_routes(endpoint, two_sessions, path):
    session = two_sessions[0]
    url = endpoint.endpoint.url + path.format(sid=session.session_id)
    for key in (None, session.api_key):
        for method in ("POST", "GET"):
            response = _call(url, method, key=key, body={} if method == "POST" else None)
            assert response.status_code == 404, (method, path, response.status_code, response.text)


def test_the_router_has_only_the_api_routes(endpoint):
    routes = {(route.method, route.resource.canonical) for route in endpoint.endpoint._runner.app.router.routes()}
    allowed = {"/health", "/s/{session_id}/v1/chat/completions", "/s/{session_id}/v1/responses",
               "/s/{session_id}/v1/messages", "/s/{session_id}/v1/messages/count_tokens", "/s/{session_id}/v1/models"}
    assert {path for _, path in routes} <= allowed, routes
    assert ("POST", "/s/{session_id}/v1/chat/completions") in routes


def test_session_keys_are_never_logged(endpoint, two_sessions, caplog):
    session, other = two_sessions
    canary = "molt-canary-key-that-must-not-be-logged"
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    saved = [(logger, logger.level) for logger in loggers]
    for logger in loggers:
        if caplog.handler not in logger.handlers and not logger.propagate:
            logger.addHandler(caplog.handler)  # also loggers that do not reach the root (vLLM's)
        logger.setLevel(logging.DEBUG)
    caplog.handler.setLevel(logging.DEBUG)
    try:
        # The capture sees records made on the endpoint's thread (the positive control).
        async def log_probe():
            logging.getLogger("molt.endpoint").debug("capture probe")

        endpoint.engine_thread.run(log_probe())
        chat_url, messages_url = f"{session.base_url}/chat/completions", f"{session.session_url}/v1/messages"
        assert _call(chat_url, "POST", key=session.api_key, body=CHAT_BODY).status_code == 200
        assert _call(chat_url, "POST", key=session.api_key, body={**CHAT_BODY, "stream": True}).status_code == 200
        assert _call(messages_url, "POST", key=session.api_key, header="x-api-key",
                     body={**CHAT_BODY, "messages": [{"role": "user", "content": "2+2="}]}).status_code == 200
        assert _call(chat_url, "POST", key=session.api_key, content=b"{not json").status_code == 400
        assert _call(chat_url, "POST", key=session.api_key,
                     body={**CHAT_BODY, "messages": [{"role": "robot", "content": "x"}]}).status_code == 400
        for key in (canary, other.api_key):
            assert _call(chat_url, "POST", key=key, body=CHAT_BODY).status_code == 401
            assert _call(messages_url, "POST", key=key, header="x-api-key", body=CHAT_BODY).status_code == 401
        endpoint.close_session(session)
        assert _call(chat_url, "POST", key=session.api_key, body=CHAT_BODY).status_code == 401
    finally:
        for logger, level in saved:
            logger.setLevel(level)
            if logger is not logging.getLogger() and caplog.handler in logger.handlers and not logger.propagate:
                logger.removeHandler(caplog.handler)
    assert any(record.getMessage() == "capture probe" for record in caplog.records)
    texts = [caplog.text] + [f"{record.getMessage()} {record.args!r} {record.exc_text or ''}"
                             for record in caplog.records]
    for secret in (session.api_key, other.api_key, canary):
        assert not any(secret in text for text in texts), f"a session key was logged: {secret}"
    assert not [record for record in caplog.records if record.name == "aiohttp.access"], "access log is on"


# -- RELIABILITY 21: the body cap ---------------------------------------------------------------


class CountingEngine:
    """The real engine; counts generation requests."""

    def __init__(self, engine):
        self.engine = engine
        self.num_streams = 0

    def stream(self, *args, **kwargs):
        self.num_streams += 1
        return self.engine.stream(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


class CountingTokenizer:
    """The real tokenizer; counts calls of any of its methods (encode, apply_chat_template...)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.num_calls = 0

    def __getattr__(self, name):
        attribute = getattr(self.tokenizer, name)
        if not callable(attribute):
            return attribute

        def counted(*args, **kwargs):
            self.num_calls += 1
            return attribute(*args, **kwargs)

        return counted


@pytest.fixture
def capped_endpoint(engine):
    counting_engine = CountingEngine(engine.engine)
    counting_tokenizer = CountingTokenizer(engine.engine.tokenizer)
    capped = SessionEndpoint(counting_engine, counting_tokenizer, model_name="molt-tiny", max_body_bytes=4096)
    counting_tokenizer.num_calls = 0  # the endpoint reads the template's end-of-turn text once, at start
    engine.run(capped.start())
    yield capped, counting_engine, counting_tokenizer
    engine.run(capped.stop())


def test_bodies_over_the_cap_get_413_before_tokenization(capped_endpoint):
    capped, counting_engine, counting_tokenizer = capped_endpoint
    session = capped.open_session(sampling=SamplingParams(max_tokens=4), max_length=256)
    big = {**CHAT_BODY, "messages": [{"role": "user", "content": "1+1= " * 20_000}]}  # ~100 KB
    assert len(json.dumps(big)) > 100_000
    chat_url, messages_url = f"{session.base_url}/chat/completions", f"{session.session_url}/v1/messages"
    for chunked in (False, True):
        response = _call(chat_url, "POST", key=session.api_key, body=big, chunked=chunked)
        assert_openai_error(response, 413, "invalid_request_error")
        response = _call(messages_url, "POST", key=session.api_key, body=big, chunked=chunked)
        assert_anthropic_error(response, 413, "request_too_large")
    assert counting_engine.num_streams == 0
    assert counting_tokenizer.num_calls == 0, "an over-cap body was tokenized"
    assert session.current is None
    # The same session then works, and the counters do see a request that is served.
    response = _call(chat_url, "POST", key=session.api_key, body=CHAT_BODY, chunked=True)
    assert response.status_code == 200, response.text
    assert counting_engine.num_streams == 1 and counting_tokenizer.num_calls > 0


# -- RELIABILITY 20: no route unpickles ---------------------------------------------------------


class CreatesFile:
    """Unpickling this runs open(path, "w"), which creates the file: proof that a load happened."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


PICKLE_CONTENT_TYPES = ["application/python-pickle", "application/x-python-pickle", "application/pickle",
                        "application/octet-stream", "application/json", None]


def test_a_crafted_pickle_is_refused_on_every_route_and_never_loaded(endpoint, tmp_path):
    """Each route, by its own method and the other one, with the pickle's own content types and
    others: 415 for a pickle content type, 400 for the rest (not JSON; a GET takes no body), 405
    for the wrong method, and the payload never runs."""
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(CreatesFile(control)))  # the payload is live: loading it creates its file
    assert control.exists()
    session = endpoint.open_session(max_tokens=4)
    try:
        routes = {route: (f"{session.base_url}/{route}", method) for route, (method, _) in ROUTES.items()}
        routes["health"] = (f"{endpoint.endpoint.url}/health", "GET")
        for (route, (url, method)), protocol, content_type in itertools.product(
                routes.items(), (0, pickle.HIGHEST_PROTOCOL), PICKLE_CONTENT_TYPES):
            marker = tmp_path / "-".join([route, str(protocol), content_type or "none"]).replace("/", "_")
            headers = {"Authorization": f"Bearer {session.api_key}"}
            if content_type is not None:
                headers["Content-Type"] = content_type
            body = pickle.dumps(CreatesFile(marker), protocol=protocol)
            with httpx.Client(timeout=60) as client:
                response = client.request(method, url, headers=headers, content=body)
                wrong_method = client.request("GET" if method == "POST" else "POST", url, headers=headers,
                                              content=body)
            status = 415 if content_type is not None and "pickle" in content_type else 400
            shape = route if route in ROUTES else "models"  # /health answers in the OpenAI shape
            assert_error_shape(response, shape, status, "invalid_request_error")
            assert_error_shape(wrong_method, shape, 405, "invalid_request_error")
            assert not marker.exists(), (route, protocol, content_type)
        assert session.current is None, "a refused request reached the session"
    finally:
        endpoint.close_session(session)


# -- RELIABILITY 23: bad requests get 400 and the session stays usable --------------------------


def test_malformed_requests_get_400_and_the_session_stays_usable(endpoint):
    session = endpoint.open_session(max_tokens=4)
    try:
        chat_url, messages_url = f"{session.base_url}/chat/completions", f"{session.session_url}/v1/messages"
        user = [{"role": "user", "content": "3+5="}]
        openai_cases = [
            (b'{"model": "molt-tiny", "messages": [', "JSON"),
            (json.dumps({**CHAT_BODY, "messages": "3+5="}).encode(), "messages"),
            (json.dumps({**CHAT_BODY, "messages": []}).encode(), "messages"),
            (json.dumps({**CHAT_BODY, "messages": [{"role": "robot", "content": "x"}]}).encode(), "robot"),
            (json.dumps({**CHAT_BODY, "max_tokens": "4"}).encode(), "max_tokens"),
        ]
        for content, mentioned in openai_cases:
            error = assert_openai_error(_call(chat_url, "POST", key=session.api_key, content=content), 400,
                                        "invalid_request_error")
            assert mentioned in error["message"], error
        anthropic_cases = [
            (b"[1, 2", "JSON"),
            (json.dumps({"model": "molt-tiny", "max_tokens": 4, "messages": []}).encode(), "messages"),
            (json.dumps({"model": "molt-tiny", "max_tokens": 4,
                         "messages": [{"role": "robot", "content": "x"}]}).encode(), "robot"),
            (json.dumps({"model": "molt-tiny", "max_tokens": "4", "messages": user}).encode(), "max_tokens"),
        ]
        for content, mentioned in anthropic_cases:
            error = assert_anthropic_error(_call(messages_url, "POST", key=session.api_key, content=content), 400,
                                           "invalid_request_error")
            assert mentioned in error["message"], error
        assert session.current is None, "a refused request was recorded"

        reply = openai.OpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) \
            .chat.completions.create(model="molt-tiny", messages=user)
        assert isinstance(reply.choices[0].message.content, str) and reply.usage.completion_tokens >= 1
        message = anthropic.Anthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0) \
            .messages.create(model="molt-tiny", max_tokens=4, messages=user)
        assert message.usage.output_tokens >= 1
        assert session.current is not None
    finally:
        endpoint.close_session(session)


# -- RELIABILITY 7: a client that goes away aborts its engine request ---------------------------


def _open_stream(session, body: dict) -> tuple[socket.socket, bytes]:
    """Send a streaming chat request over a raw socket; return it once the first SSE event is in."""
    url = urlsplit(f"{session.base_url}/chat/completions")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(f"POST {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {session.api_key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while b"data: {" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the stream before the first event: {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    return sock, received


@pytest.mark.parametrize("how", ["close", "reset"])
def test_client_disconnect_mid_stream_aborts_the_engine_request(engine, endpoint, how):
    """Read the first event, then freeze the engine (pause, keeping requests) so the request can
    neither finish on its own nor make the server write: only noticing the closed connection can
    end it. Then go away, with a FIN (`close`) or a RST (`reset`)."""
    llm = engine.engine.llm
    aborts = []  # (time, unfinished requests just before the abort)
    original_abort = llm.abort

    async def recording_abort(request_id, internal=False):
        aborts.append((time.monotonic(), llm.get_num_unfinished_requests()))
        return await original_abort(request_id, internal=internal)

    llm.abort = recording_abort
    session = endpoint.open_session(max_tokens=240, temperature=1.0, max_length=256)
    caught_mid_generation = False
    try:
        for attempt in range(5):  # a random model can end before the pause lands; then try again
            aborts.clear()
            body = {**CHAT_BODY, "max_tokens": 240, "stream": True, "seed": attempt,
                    "messages": [{"role": "user", "content": "Count to one hundred."}]}
            sock, received = _open_stream(session, body)
            engine.run(llm.pause_generation(mode="keep", clear_cache=False))
            try:
                if not llm.get_num_unfinished_requests():
                    sock.close()
                    continue
                caught_mid_generation = True
                assert b"[DONE]" not in received and b'"finish_reason": "' not in received
                if how == "reset":  # an abortive close: RST instead of FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                closing_at = time.monotonic()  # before the close: the abort may land before close() returns
                sock.close()
                closed_at = time.monotonic()
                # The engine is paused, so only an abort can end the request: wait for that event
                # (30 s: generous for a loaded machine; it takes milliseconds), not a fixed window.
                while llm.get_num_unfinished_requests() and time.monotonic() - closed_at < 30:
                    time.sleep(0.005)
                drained_seconds = time.monotonic() - closed_at
                drained = not llm.get_num_unfinished_requests()
            finally:
                engine.run(llm.resume_generation())
            assert drained, f"the engine request outlived its client by {drained_seconds:.2f} s"
            assert len(aborts) == 1 and aborts[0][1] == 1, aborts
            assert aborts[0][0] >= closing_at  # aborted because the client went away
            break
    finally:
        del llm.abort
    assert caught_mid_generation, "every attempt finished before the engine was paused"
    assert session.current is None, "an aborted generation was recorded"
    # The session is still usable.
    response = _call(f"{session.base_url}/chat/completions", "POST", key=session.api_key, body=CHAT_BODY)
    assert response.status_code == 200, response.text
    endpoint.close_session(session)


# -- RELIABILITY 8 and 9: ChatAgent failures ----------------------------------------------------


def _rollout(rollout_id: int) -> RolloutRequest:
    return RolloutRequest(rollout_id=rollout_id, group_id=0, sample_index=0,
                          messages=[{"role": "user", "content": "3+5="}], label="8", tools=None,
                          sampling=SamplingParams(max_tokens=4), max_length=128, max_turns=1, policy_version=0)


async def _ask(ctx):
    async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        return await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)


class AsksOnce(ChatAgent):
    async def run(self, ctx):
        reply = await _ask(ctx)
        return Result(reward=float(reply.choices[0].message.content.strip() == ctx.label))


class HangsForever(ChatAgent):
    contexts = []

    async def run(self, ctx):
        HangsForever.contexts.append(ctx)
        await _ask(ctx)
        await asyncio.Event().wait()


class Raises(ChatAgent):
    contexts = []

    async def run(self, ctx):
        Raises.contexts.append(ctx)
        await _ask(ctx)
        raise ValueError("agent bug 42")


class NeverCallsTheModel(ChatAgent):
    contexts = []

    async def run(self, ctx):
        NeverCallsTheModel.contexts.append(ctx)
        return Result(reward=1.0)


class ReturnsADict(ChatAgent):
    contexts = []

    async def run(self, ctx):
        ReturnsADict.contexts.append(ctx)
        await _ask(ctx)
        return {"reward": 1.0}


def _runner(endpoint, agent_class) -> ChatAgentRunner:
    runner = ChatAgentRunner(agent_class)
    runner.endpoint = endpoint.endpoint
    return runner


def _assert_session_ended(endpoint, ctx) -> None:
    assert ctx.session_id not in endpoint.endpoint.sessions
    assert_openai_error(_call(f"{ctx.base_url}/models", "GET", key=ctx.api_key), 401, "authentication_error")
    assert_openai_error(_call(f"{ctx.base_url}/chat/completions", "POST", key=ctx.api_key, body=CHAT_BODY), 401,
                        "authentication_error")


def test_a_hung_agent_is_ended_at_the_timeout_and_others_run_meanwhile(engine, endpoint):
    HangsForever.contexts.clear()
    hung, normal = _runner(endpoint, HangsForever), _runner(endpoint, AsksOnce)
    # Alone first: the baseline, and the engine's first-request warm-up out of the way.
    started = time.monotonic()
    alone = engine.run(run_with_timeout(normal, _rollout(0), engine.engine, engine.engine.tokenizer, 60.0))
    alone_seconds = time.monotonic() - started
    assert alone.failure == "", alone.error
    # The hung agent's timeout leaves the normal one several times what it took alone, so "it
    # finished first" holds on a loaded machine too (2 s where a rollout takes a fraction of one).
    timeout_seconds = round(max(2.0, 5 * alone_seconds), 1)

    async def race():
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def timed(runner, request, timeout):
            outcome = await run_with_timeout(runner, request, engine.engine, engine.engine.tokenizer, timeout)
            return outcome, loop.time() - start

        return await asyncio.gather(timed(hung, _rollout(1), timeout_seconds), timed(normal, _rollout(2), 30.0))

    (hung_outcome, hung_seconds), (normal_outcome, normal_seconds) = engine.run(race())
    assert hung_outcome.failure == "timeout" and hung_outcome.experiences == []
    assert f"rollout_timeout_seconds={timeout_seconds}" in hung_outcome.error
    # Ended at its timeout, not before; the upper bound is generous (it would otherwise hang forever).
    assert timeout_seconds <= hung_seconds < timeout_seconds + 30
    assert normal_outcome.failure == "", normal_outcome.error
    (experience,) = normal_outcome.experiences
    assert sum(experience.action_mask) >= 1
    # Ordering, not a time window: the normal rollout ended while the hung one still held its session.
    assert normal_seconds < hung_seconds, \
        f"a normal rollout took {normal_seconds:.2f} s beside a hung one, {alone_seconds:.2f} s alone"
    (ctx,) = HangsForever.contexts
    _assert_session_ended(endpoint, ctx)


@pytest.mark.parametrize("agent_class, failure, mentioned", [
    (Raises, "agent_error", "ValueError: agent bug 42"),
    (NeverCallsTheModel, "no_generation", "never called the model"),
    (ReturnsADict, "bad_result", "ReturnsADict.run returned dict"),
])
def test_failing_agents_fail_their_rollout_and_end_their_session(engine, endpoint, agent_class, failure,
                                                                  mentioned):
    agent_class.contexts.clear()
    outcome = engine.run(run_with_timeout(_runner(endpoint, agent_class), _rollout(3), engine.engine,
                                          engine.engine.tokenizer, 30.0))
    assert outcome.failure == failure and outcome.experiences == []
    assert mentioned in outcome.error, outcome.error
    (ctx,) = agent_class.contexts
    _assert_session_ended(endpoint, ctx)
