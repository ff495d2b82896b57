"""llm_serving.kserve_stream: reading a ModelStreamInfer stream up to the final response (no server: tritonclient's
own response messages, with the final flag as the servers set it; what the embedded server's C++ front-end writes
is read through tritonclient in tests/serving/test_openai_embedded.py)."""

from __future__ import annotations

import asyncio
import queue

import pytest
from tritonclient.grpc import InferResult, service_pb2

from llm_serving.kserve_stream import FINAL_PARAMETER, is_final, until_final, until_final_async


def infer_response(model: str, version: str, request_id: str, final: bool) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    response.parameters[FINAL_PARAMETER].bool_param = final
    return response


def _result(request_id: str, final: bool) -> InferResult:
    return InferResult(infer_response("m", "1", request_id, final))


def test_is_final_reads_the_parameter_of_a_result_or_a_bare_response():
    assert is_final(_result("a", True)) and not is_final(_result("a", False))
    assert is_final(infer_response("m", "1", "a", True))


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
