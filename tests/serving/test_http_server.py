"""The HTTP front-ends' keep-alive (serving_image/http_server.py): longer than the load balancer's idle timeout, so
the server never closes an idle connection that a client or the balancer is about to reuse."""

from __future__ import annotations

import pytest

from llm_serving import pod_contract as pc
from serving_image.http_server import DEFAULT_KEEPALIVE_S, KEEPALIVE_ENV, keepalive_s, uvicorn_server

HTTPX_KEEPALIVE_EXPIRY_S = 5  # httpx's default idle expiry (the benchmark's and the openai client's pools)


def test_each_hop_closes_idle_connections_before_the_next_hop_does():
    """Client pool < the Gateway's upstream idle timeout < the pod's keep-alive; the Gateway's client idle timeout <
    the NLB's (AWS's fixed 350 s for TCP): the side that would reuse an idle connection always closes it first."""
    assert HTTPX_KEEPALIVE_EXPIRY_S < pc.GATEWAY_UPSTREAM_IDLE_TIMEOUT_S < keepalive_s({}) == DEFAULT_KEEPALIVE_S
    assert pc.GATEWAY_CLIENT_IDLE_TIMEOUT_S < pc.NLB_TCP_IDLE_TIMEOUT_S
    assert pc.POD_ENV[KEEPALIVE_ENV] == str(DEFAULT_KEEPALIVE_S)  # the Deployment sets it (infra/serving.py)


def test_every_front_end_server_gets_it(monkeypatch):
    monkeypatch.delenv(KEEPALIVE_ENV, raising=False)
    assert uvicorn_server(object(), "127.0.0.1", 0).config.timeout_keep_alive == DEFAULT_KEEPALIVE_S
    monkeypatch.setenv(KEEPALIVE_ENV, "400")
    assert uvicorn_server(object(), "127.0.0.1", 0).config.timeout_keep_alive == 400


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "forever", ""])
def test_a_bad_value_names_the_variable(value):
    with pytest.raises(ValueError, match=KEEPALIVE_ENV):
        keepalive_s({KEEPALIVE_ENV: value})
