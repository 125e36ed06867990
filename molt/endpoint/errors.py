"""Request errors and their shape in each API.

Everything the endpoint refuses is a RequestError (status, message, OpenAI-style type, the
offending field, a machine-readable code); each API renders it its own way, so an SDK raises its
usual typed exception (BadRequestError, AuthenticationError, ...) with Molt's message.
"""

from __future__ import annotations

from aiohttp import web

ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "api_error", 503: "api_error"}


class RequestError(Exception):
    """A request the endpoint refuses or could not serve."""

    def __init__(self, status: int, message: str, kind: str = "", *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or OPENAI_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code


class ContextLengthExceeded(RequestError):
    """The conversation no longer fits the session's context (`rollout.max_length`)."""

    def __init__(self, prompt_tokens: int, max_length: int):
        super().__init__(400, f"This model's maximum context length is {max_length} tokens (rollout.max_length); "
                              f"the conversation is {prompt_tokens} tokens. Shorten or compact the history.",
                         param="messages", code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.max_length = max_length


def openai_error_body(error: RequestError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}


def anthropic_error_body(error: RequestError) -> dict:
    kind = ANTHROPIC_TYPES.get(error.status, "invalid_request_error")
    message = error.message
    if isinstance(error, ContextLengthExceeded):
        # Anthropic's own wording, which agent frameworks match on to detect context overflow.
        message = f"prompt is too long: {error.prompt_tokens} tokens > {error.max_length} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(api: str, error: RequestError) -> web.Response:
    """The error as a plain (non-streamed) response of `api` ('openai' or 'anthropic')."""
    body = anthropic_error_body(error) if api == "anthropic" else openai_error_body(error)
    return web.json_response(body, status=error.status)
