"""llm_serving.kserve_stream: reading a ModelStreamInfer stream up to the final response (no server: tritonclient's
own response messages, as the server builds them)."""

from __future__ import annotations

import asyncio
import queue

import numpy as np
import pytest
from tritonclient.grpc import InferResult

from llm_serving.kserve_stream import is_final, until_final, until_final_async
from serving_image.kserve.triton_grpc import infer_response
from serving_image.triton.capi import TritonError


def _result(request_id: str, final: bool) -> InferResult:
    return InferResult(infer_response("m", "1", request_id, {}, final))


def test_is_final_reads_the_parameter_of_a_result_or_a_bare_response():
    assert is_final(_result("a", True)) and not is_final(_result("a", False))
    assert is_final(infer_response("m", "1", "a", {}, True))


def test_until_final_stops_after_the_final_response_and_leaves_the_rest():
    got: queue.Queue = queue.Queue()
    for item in ((_result("a", False), None), (None, "boom"), (_result("a", True), None), (_result("b", True), None)):
        got.put(item)
    seen = list(until_final(got, timeout=1))
    assert [(r and r.get_response().id, e) for r, e in seen] == [("a", None), (None, "boom"), ("a", None)]
    assert got.qsize() == 1


def test_until_final_counts_finals_of_several_requests_and_times_out_per_response():
    got: queue.Queue = queue.Queue()
    for item in ((_result("a", True), None), (_result("b", False), None), (_result("b", True), None)):
        got.put(item)
    assert len(list(until_final(got, timeout=1, finals=2))) == 3
    with pytest.raises(queue.Empty):
        list(until_final(got, timeout=0.01))


def test_until_final_async_stops_at_the_final_response_of_an_open_stream():
    async def stream():
        yield _result("a", False), None
        yield _result("a", True), None
        await asyncio.sleep(3600)  # the stream stays open, as tritonclient's does while the request side is

    async def read():
        return [r.get_response().id for r, _ in [pair async for pair in until_final_async(stream())]]

    assert asyncio.run(asyncio.wait_for(read(), 10)) == ["a", "a"]


def test_a_response_carries_tritons_bytes_as_tritonclient_reads_them():
    raw = {"text_output": ("BYTES", (1,), [b"hello \xe2\x9c\x93"]),
           "scores": ("FP32", (2, 2), np.arange(4, dtype=np.float32).tobytes()),
           "flat": ("INT64", (5,), np.arange(3, dtype=np.int64).tobytes())}  # a shape that does not hold 3 elements
    result = InferResult(infer_response("m", "1", "a", raw, None))
    assert result.as_numpy("text_output").tolist() == [b"hello \xe2\x9c\x93"]
    assert result.as_numpy("scores").tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert result.as_numpy("flat").tolist() == [0, 1, 2]  # sent flat, its element count as the shape
    with pytest.raises(TritonError, match="output 'x': datatype INVALID"):
        infer_response("m", "1", "a", {"x": ("INVALID", (1,), b"")}, None)
