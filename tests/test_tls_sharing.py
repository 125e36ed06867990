"""molt.agents.tls: SDK clients built per rollout share one default TLS context, nothing else is shared."""

import ssl

import httpx
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from molt.agents.tls import share_default_tls_context


def openai_context(client: AsyncOpenAI) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context


@pytest.fixture(scope="module", autouse=True)
def shared():
    assert set(share_default_tls_context()) == {"httpx2._transports.default", "httpx._transports.default"}


def test_clients_built_per_rollout_share_one_default_context():
    first, second = (AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k") for _ in range(2))
    anthropic = AsyncAnthropic(base_url="http://127.0.0.1:9", api_key="k")
    context = openai_context(first)
    assert context is openai_context(second) is anthropic._client._transport._pool._ssl_context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert share_default_tls_context() and openai_context(AsyncOpenAI(api_key="k")) is context  # idempotent


def test_other_settings_are_built_as_before():
    default = httpx.AsyncClient()._transport._pool._ssl_context
    unverified = httpx.AsyncClient(verify=False)._transport._pool._ssl_context
    assert unverified is not default and unverified.verify_mode == ssl.CERT_NONE
    custom = ssl.create_default_context()
    assert httpx.AsyncClient(verify=custom)._transport._pool._ssl_context is custom


def test_ca_bundle_environment_is_part_of_the_key(monkeypatch, tmp_path):
    default = httpx.AsyncClient()._transport._pool._ssl_context
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))
    other = httpx.AsyncClient()._transport._pool._ssl_context
    assert other is not default
    assert httpx.AsyncClient()._transport._pool._ssl_context is other
