"""One route driver for every API: parse the request with the API's translator, run it on the
session, and answer with one JSON object or a server-sent event stream.

A translator is the whole of an API: `parse` turns a request body into the neutral ChatRequest,
`build` turns a Reply into the API's response object, and `open_stream` gives the writer of its
event stream. The driver owns what all APIs share: retry headers, error responses in the API's
shape, when the HTTP status is committed, client disconnects and failures mid-stream.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Protocol

from aiohttp import web

from molt.endpoint.errors import RequestError, error_response
from molt.endpoint.fields import read_json_object
from molt.endpoint.messages import ChatRequest, Reply, Started, ToolCall

logger = logging.getLogger("molt")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EventWriter(Protocol):
    """Writes one reply as an API's event stream."""

    async def start(self, started: Started) -> None: ...

    async def text(self, text: str) -> None: ...

    async def tool_call(self, call: ToolCall) -> None: ...

    async def end(self, reply: Reply) -> None: ...

    async def error(self, error: RequestError) -> None:
        """An error after the stream began, as the API reports one in the stream."""


class Translator(Protocol):
    api: str  # 'openai' | 'anthropic': the error shape

    def parse(self, body: dict, session) -> ChatRequest: ...

    def build(self, reply: Reply, chat: ChatRequest, session) -> dict: ...

    def open_stream(self, response: web.StreamResponse, chat: ChatRequest, session) -> EventWriter: ...


async def handle_request(request: web.Request, session, translator: Translator) -> web.StreamResponse:
    try:
        chat = translator.parse(await read_json_object(request), session)
        chat.retry = _retry_count(request) > 0
        chat.idempotency_key = request.headers.get("Idempotency-Key")
        if not chat.stream:
            reply = await session.complete(chat)
            return web.json_response(translator.build(reply, chat, session))
    except RequestError as error:
        return error_response(translator.api, error)
    return await _stream(request, session, chat, translator)


async def _stream(request: web.Request, session, chat: ChatRequest, translator: Translator) -> web.StreamResponse:
    """The HTTP status waits for the session's Started, so a request it refuses (a bad or too long
    conversation) still gets a plain error response. Closing the session's stream, also when the
    client went away and its handler is cancelled, aborts the engine request."""
    async with aclosing(session.stream(chat)) as items:
        try:
            started = await anext(items)
        except RequestError as error:
            return error_response(translator.api, error)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        writer = translator.open_stream(response, chat, session)
        try:
            await writer.start(started)
            async for item in items:
                if isinstance(item, Reply):
                    await writer.end(item)
                elif isinstance(item, ToolCall):
                    await writer.tool_call(item)
                else:
                    await writer.text(item)
        except ConnectionResetError:
            logger.debug("client of session %s went away mid-stream", session.session_id)
            return response
        except RequestError as error:
            await writer.error(error)
        except Exception:
            logger.exception("streamed reply failed in session %s", session.session_id)
            await writer.error(RequestError(500, "the endpoint failed mid-stream; see the Molt log", "api_error"))
    await response.write_eof()
    return response


def _retry_count(request: web.Request) -> int:
    try:
        return int(request.headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        return 0
