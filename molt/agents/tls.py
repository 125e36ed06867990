"""One default TLS context per agent process for the SDK clients that agents build per rollout.

`AsyncOpenAI(...)` and `AsyncAnthropic(...)` each build an httpx transport, and every transport
builds a fresh `ssl.SSLContext` with the system CA bundle loaded, even for a plain-http base URL
such as the session endpoint's. Loading the bundle costs ~30-50 ms of CPU on the agent worker's
event loop, which runs all its rollouts, so an agent written the natural way (a new client per
rollout) would spend more time there than in generation. `share_default_tls_context` makes the
default verifying context (verify=True, no client certificate) a per-process singleton, keyed on
the environment variables that choose the CA bundle. Other settings (verify=False, a custom
context, a client certificate) are built as before.

The shared context is only read by connections, except that httpcore sets its ALPN protocols
(http/1.1 or h2) before each TLS handshake; clients mixing HTTP/2 and HTTP/1.1 to HTTPS hosts in
one agent process could negotiate the other's protocol list. Set `agent.share_tls_context=False`
for such agents.
"""

from __future__ import annotations

import functools
import importlib
import os
import ssl

# httpx2 is the fork the current OpenAI and Anthropic SDKs use; httpx for agents that use it directly.
_TRANSPORT_MODULES = ("httpx2._transports.default", "httpx._transports.default")


def share_default_tls_context() -> list[str]:
    """Patch each importable httpx flavour; returns the modules patched (idempotent)."""
    patched = []
    for name in _TRANSPORT_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        build = getattr(module, "create_ssl_context", None)
        if build is None:
            continue
        if not getattr(build, "molt_shared", False):
            module.create_ssl_context = _sharing(build)
        patched.append(name)
    return patched


def _sharing(build):
    @functools.lru_cache(maxsize=8)
    def default_context(trust_env: bool, cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
        return build(verify=True, cert=None, trust_env=trust_env)

    @functools.wraps(build)
    def create_ssl_context(verify=True, cert=None, trust_env: bool = True):
        if verify is True and cert is None:
            return default_context(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return build(verify=verify, cert=cert, trust_env=trust_env)

    create_ssl_context.molt_shared = True
    return create_ssl_context
