"""KServe v2 HTTP `/infer` bodies (serving_image/kserve/infer_json.py) as NVIDIA's tritonclient.http writes and
reads them: its own request encoder (JSON and the binary tensor extension) and its own response parser, no server.
The same front-end answers tritonclient.http against the embedded Triton in tests/serving/test_openai_embedded.py."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient

from serving_image.kserve.infer_json import InferBodyError, infer_response_body, parse_infer_body

_SHORT = b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 4}}]}'
_ONE = b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [1], "data": [1]}]}'
FEATURES = np.arange(12, dtype=np.float32).reshape(3, 4) / 7


def _encode(inputs, outputs=None, **kwargs) -> tuple[bytes, str | None]:
    body, header_length = httpclient.InferenceServerClient.generate_request_body(inputs, outputs, **kwargs)
    return body, None if header_length is None else str(header_length)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_requests_decode_to_the_same_tensors(binary):
    features = httpclient.InferInput("FEATURES", list(FEATURES.shape), "FP32")
    features.set_data_from_numpy(FEATURES, binary_data=binary)
    labels = httpclient.InferInput("LABELS", [2], "BYTES")
    labels.set_data_from_numpy(np.array([b"a", "é".encode()], dtype=np.object_), binary_data=binary)
    call = parse_infer_body(*_encode([features, labels], request_id="r1"))
    assert call.request_id == "r1" and call.outputs == []
    first, second = call.inputs
    assert (first.name, first.datatype, first.shape) == ("FEATURES", "FP32", (3, 4))
    assert np.array_equal(np.frombuffer(first.data, dtype=np.float32).reshape(3, 4), FEATURES)
    assert second.data == struct.pack("<I", 1) + b"a" + struct.pack("<I", 2) + "é".encode()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_responses_parse_with_tritonclient(binary):
    features = httpclient.InferInput("FEATURES", [3, 4], "FP32")
    features.set_data_from_numpy(FEATURES)
    requested = [httpclient.InferRequestedOutput("SCORES", binary_data=binary),
                 httpclient.InferRequestedOutput("NAMES", binary_data=binary)]
    call = parse_infer_body(*_encode([features], requested))
    scores = np.array([[0.5], [-1.25], [3.0]], dtype=np.float32)
    names = np.array([b"x", b"yz", b""], dtype=np.object_)
    body, headers = infer_response_body(call, "ranker", "1", {"SCORES": scores, "NAMES": names, "UNASKED": scores})
    assert bool(headers) is binary
    result = httpclient.InferenceServerClient.parse_response_body(
        body, header_length=int(headers["Inference-Header-Content-Length"]) if headers else None)
    assert np.array_equal(result.as_numpy("SCORES"), scores)
    assert result.as_numpy("NAMES").tolist() == ([b"x", b"yz", b""] if binary else ["x", "yz", ""])
    assert result.get_output("UNASKED") is None and result.get_response()["model_name"] == "ranker"


def test_no_outputs_named_returns_every_output_binary_or_json_as_the_request_says():
    features = httpclient.InferInput("FEATURES", [3, 4], "FP32")
    features.set_data_from_numpy(FEATURES, binary_data=False)
    call = parse_infer_body(*_encode([features]))  # tritonclient asks for binary_data_output then
    body, headers = infer_response_body(call, "ranker", "", {"SCORES": np.ones((3, 1), dtype=np.float32)})
    result = httpclient.InferenceServerClient.parse_response_body(
        body, header_length=int(headers["Inference-Header-Content-Length"]))
    assert result.as_numpy("SCORES").tolist() == [[1.0], [1.0], [1.0]]
    call = parse_infer_body(json.dumps({"inputs": [{"name": "F", "datatype": "FP32", "shape": [1], "data": [1]}]})
                            .encode(), None)
    body, headers = infer_response_body(call, "ranker", "", {"SCORES": np.ones((3, 1), dtype=np.float32)})
    assert headers == {}
    assert json.loads(body)["outputs"] == [{"name": "SCORES", "datatype": "FP32", "shape": [3, 1],
                                            "data": [1.0, 1.0, 1.0]}]


@pytest.mark.parametrize(("body", "header", "message"), [
    (b"{", None, "not valid JSON"),
    (b"[]", None, "JSON object"),
    (b'{"inputs": []}', None, "non-empty list"),
    (b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [2], "data": [1.0]}]}', None,
     r"input 'F': 1 values for shape \[2\]"),
    (b'{"inputs": [{"name": "F", "datatype": "COMPLEX", "shape": [1], "data": [1]}]}', None, "datatype 'COMPLEX'"),
    (b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None, "shape"),
    (b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [1], "data": ["x"]}]}', None, "must be numbers"),
    (b'{"inputs": [{"name": "F", "datatype": "FP32", "shape": [1]}]}', None, "neither data nor"),
    (_SHORT + b"\x00\x00\x80?", str(len(_SHORT)), "needs 8"),
    (_ONE + b"xx", str(len(_ONE)), "2 bytes of binary data belong to no input"),
    (b"{}", "99", "Inference-Header-Content-Length"),
])
def test_bad_bodies_name_what_is_wrong(body, header, message):
    with pytest.raises(InferBodyError, match=message):
        parse_infer_body(body, header)
