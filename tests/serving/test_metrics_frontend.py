"""`serve_exposition` (serving_image/metrics/frontend.py): the internal metrics port where embedded Triton's metrics
text waits for the metrics proxy. The body here is a fixed text; embedded Triton's own, served the same way, is read
through the proxy in test_openai_embedded.py."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from serving_image.metrics.frontend import serve_exposition
from tests.serving.test_metrics_helpers import get, series

BODY = b'# TYPE nv_inference_count counter\nnv_inference_count{model="m",version="1"} 3\n'


def test_serves_the_body_as_text_0_0_4_on_metrics_only():
    calls = []

    def body() -> bytes:
        calls.append(1)
        return BODY

    server = serve_exposition(body, port=0)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        status, content_type, text = get(server.url)
        get(server.url + "?x=1")
        with pytest.raises(urllib.error.HTTPError) as err:
            get(f"http://127.0.0.1:{server.port}/other")
    finally:
        server.stop()
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    assert series(text) == {'nv_inference_count{model="m",version="1"}': 3}  # as given: no `_total` added
    assert len(calls) == 2  # read afresh on every scrape
    assert err.value.code == 404


def test_a_failing_body_is_a_503_not_a_hang():
    def body() -> bytes:
        raise RuntimeError("Triton is stopping")

    server = serve_exposition(body, port=0)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            get(server.url, timeout=10)
    finally:
        server.stop()
    assert err.value.code == 503


def test_stop_closes_the_port():
    server = serve_exposition(lambda: BODY, port=0)
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)
