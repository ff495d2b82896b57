"""The HTTP front-ends' keep-alive (serving_image/http_server.py): longer than the load balancer's idle timeout, so
the server never closes an idle connection that a client or the balancer is about to reuse (issue 14, scope 5)."""

from __future__ import annotations

import pytest

from serving_image.http_server import DEFAULT_KEEPALIVE_S, KEEPALIVE_ENV, keepalive_s, uvicorn_server

AWS_LOAD_BALANCER_IDLE_TIMEOUT_S = 60  # the default of AWS's ALB and NLB idle timeouts
HTTPX_KEEPALIVE_EXPIRY_S = 5  # httpx's default idle expiry (the benchmark's and the openai client's pools)


def test_default_keepalive_outlasts_the_balancer_and_the_client_pools():
    assert keepalive_s({}) == DEFAULT_KEEPALIVE_S > AWS_LOAD_BALANCER_IDLE_TIMEOUT_S > HTTPX_KEEPALIVE_EXPIRY_S


def test_every_front_end_server_gets_it(monkeypatch):
    monkeypatch.delenv(KEEPALIVE_ENV, raising=False)
    assert uvicorn_server(object(), "127.0.0.1", 0).config.timeout_keep_alive == DEFAULT_KEEPALIVE_S
    monkeypatch.setenv(KEEPALIVE_ENV, "400")
    assert uvicorn_server(object(), "127.0.0.1", 0).config.timeout_keep_alive == 400


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "forever", ""])
def test_a_bad_value_names_the_variable(value):
    with pytest.raises(ValueError, match=KEEPALIVE_ENV):
        keepalive_s({KEEPALIVE_ENV: value})
