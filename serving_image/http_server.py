"""The uvicorn server every HTTP front-end of the pod runs on (OpenAI 9000, KServe HTTP 8000): one place for how
connections are kept.

Keep-alive. A client pool reuses an idle connection at the moment the server closes it: the
request goes out on a dead socket and ends in `ReadError('')` (a connection closed without a response; `make
bench`'s soak lost 3 of 12,147 requests this way with uvicorn's default of 5 s, which equals httpx's own idle expiry).
Behind a load balancer the same race turns into 502s unless the server keeps idle connections open longer than the
balancer does (AWS load balancers: 60 s by default). So the server's keep-alive is longer than every client's and
every balancer's idle timeout: `LLM_SERVING_HTTP_KEEPALIVE_S`, 75 s by default, set by the Deployment; the Gateway's
upstream idle timeout is 60 s (both from llm_serving/pod_contract.py, where the chain of idle timeouts is explained).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

from llm_serving.pod_contract import ENV_HTTP_KEEPALIVE as KEEPALIVE_ENV
from llm_serving.pod_contract import HTTP_KEEPALIVE_S as DEFAULT_KEEPALIVE_S

GRACE_S = 30


def keepalive_s(environ=os.environ) -> int:
    value = environ.get(KEEPALIVE_ENV)
    if value is None:
        return DEFAULT_KEEPALIVE_S
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{KEEPALIVE_ENV}={value!r}: expected a positive whole number of seconds (longer than the "
                         "load balancer's idle timeout)")
    return int(value)


def uvicorn_server(app, host: str, port: int, *, grace_s: int = GRACE_S):
    """uvicorn's server without its own signal handling (the startup procedure owns SIGINT/SIGTERM: drain first),
    with the pod's keep-alive."""
    import uvicorn

    class Server(uvicorn.Server):
        def capture_signals(self):
            return nullcontext()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=grace_s, lifespan="off", timeout_keep_alive=keepalive_s())
    return Server(config)
