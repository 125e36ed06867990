"""The session endpoint: an HTTP server on each rollout rank that agents reach with the official
OpenAI or Anthropic SDK (DESIGN section 4).

Routes live under `/s/<session_id>`: `POST /v1/chat/completions` and `POST /v1/responses`
(OpenAI), `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic), `GET
/v1/models`; plus `GET /health`. Every session has its own key (Bearer token
or `x-api-key`), compared in constant time; an unknown, ended or wrong key gets 401. Bodies over
the cap get 413 before they are parsed; only JSON is parsed (a pickle content type gets 415, a body
on a GET route 400). There are no control routes on this listener.
"""

from __future__ import annotations

import hmac
import logging
import secrets

from aiohttp import web

from molt.agents.base import SamplingParams
from molt.agents.chat import SessionRecord
from molt.endpoint.anthropic_messages import handle_count_tokens, handle_messages
from molt.endpoint.errors import RequestError, error_response
from molt.endpoint.images import PromptImages
from molt.endpoint.openai_chat import handle_chat_completions, handle_models
from molt.endpoint.openai_responses import handle_responses
from molt.endpoint.session import Session
from molt.endpoint.template_check import turn_end_text
from molt.endpoint.tool_calls import build_tool_call_parser_factory

logger = logging.getLogger("molt")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


def _error_for(request: web.Request, status: int, message: str) -> web.Response:
    """The error shape of the API the path belongs to."""
    api = "anthropic" if "/v1/messages" in request.path else "openai"
    return error_response(api, RequestError(status, message))


class SessionEndpoint:
    """One per rollout rank. Sessions are opened and closed for the agent workers by the rank's
    AgentWorkerPool (or by a runner in this process, in tests)."""

    def __init__(self, engine, tokenizer, *, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: str = "hermes",
                 image_root: str = ""):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self.sessions: dict[str, Session] = {}
        self.turn_end = turn_end_text(tokenizer)
        self.tool_parser = build_tool_call_parser_factory(tool_call_parser, tokenizer)
        # Image parts: data URIs, or files under image_root (agent.image_root); the processor of the
        # engine's model expands them (molt.endpoint.images).
        self.images = PromptImages(tokenizer.name_or_path, file_root=image_root)
        self._num_opened = 0  # sessions opened so far: each one's seed salt
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors, _refuse_foreign_bodies])
        app.router.add_get("/health", self._health)
        app.router.add_post("/s/{session_id}/v1/chat/completions", self._with_session(handle_chat_completions))
        app.router.add_post("/s/{session_id}/v1/messages", self._with_session(handle_messages))
        app.router.add_post("/s/{session_id}/v1/messages/count_tokens", self._with_session(handle_count_tokens))
        app.router.add_post("/s/{session_id}/v1/responses", self._with_session(handle_responses))
        app.router.add_get("/s/{session_id}/v1/models", self._with_session(handle_models))
        # handler_cancellation: a client that disconnects cancels its handler, which closes the
        # engine stream and so aborts the engine request.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        logger.info("session endpoint on http://%s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open_session(self, *, sampling: SamplingParams, max_length: int) -> Session:
        session_id = secrets.token_hex(8)
        session = Session(session_id=session_id, api_key=f"molt-{secrets.token_urlsafe(24)}",
                          model_name=self.model_name, engine=self.engine, tokenizer=self.tokenizer,
                          sampling=sampling, max_length=max_length, base_url=f"{self.url}/s/{session_id}",
                          turn_end=self.turn_end, seed_salt=self._num_opened, tool_parser=self.tool_parser,
                          images=self.images)
        self._num_opened += 1
        self.sessions[session_id] = session
        return session

    def close_session(self, session: Session) -> None:
        session.closed = True
        self.sessions.pop(session.session_id, None)

    # The SessionHost interface of a ChatAgentRunner (molt/agents/chat.py), for a runner in this
    # process; agent workers reach the same two through the rank (molt/rollout/agent_pool.py).

    async def begin_session(self, *, sampling: SamplingParams, max_length: int) -> Session:
        return self.open_session(sampling=sampling, max_length=max_length)

    async def end_session(self, session: Session) -> SessionRecord:
        """Close the session and hand over what it recorded."""
        self.close_session(session)
        return SessionRecord(segments=session.all_segments(), ledger=dict(session.ledger.counts),
                             context_exhausted=session.context_exhausted)

    # -- middleware and wrappers ------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error_for(request, 413, f"request body exceeds {self.max_body_bytes} bytes")
        except web.HTTPNotFound:
            return _error_for(request, 404, f"no route {request.method} {request.path}")
        except web.HTTPMethodNotAllowed:
            return _error_for(request, 405, f"method {request.method} not allowed on {request.path}")
        except web.HTTPException:
            raise
        except Exception as error:  # a bug of ours: still an API-shaped error, and logged
            logger.exception("session endpoint: %s %s failed", request.method, request.path)
            return _error_for(request, 500, f"internal error: {type(error).__name__}")

    def _with_session(self, handler):
        async def wrapped(request: web.Request) -> web.StreamResponse:
            session = self.sessions.get(request.match_info["session_id"])
            presented = _presented_key(request)
            expected = session.api_key if session is not None else "molt-no-such-session-key"
            # Compare even for unknown sessions, so timing does not tell which ids exist.
            key_ok = hmac.compare_digest(presented.encode(), expected.encode())
            if session is None or session.closed or not key_ok:
                return _error_for(request, 401, "invalid or expired session key")
            if request.content_length is not None and request.content_length > self.max_body_bytes:
                return _error_for(request, 413, f"request body exceeds {self.max_body_bytes} bytes")
            if request.body_exists:
                # A chunked body has no Content-Length: read it here under the cap (over it raises
                # 413 into the middleware), so no route can parse it or turn the 413 into a 500.
                await request.read()
            return await handler(request, session)

        return wrapped

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions)})


@web.middleware
async def _refuse_foreign_bodies(request: web.Request, handler):
    """No route parses anything but a JSON body (RELIABILITY 20): a body labelled as a pickle gets
    415 and a body sent to a GET route (which reads none) 400, before any handler or session sees
    it. Other bodies reach the routes' JSON parser, which refuses what is not JSON."""
    if request.match_info.http_exception is None:  # a route matched; else the 404 or 405
        if "pickle" in request.content_type:
            return _error_for(request, 415, f"Content-Type {request.content_type!r} is not accepted; send "
                                            f"application/json")
        if request.method in ("GET", "HEAD") and request.body_exists:
            return _error_for(request, 400, f"{request.method} {request.path} takes no request body")
    return await handler(request)


def _presented_key(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-api-key", "")
