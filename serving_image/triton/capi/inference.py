"""Inference through the C API: a request's inputs, parameters and requested outputs; responses delivered into
asyncio; cancellation.

The response path runs in C++ (native/triton/response_path.hpp, the `_response_path` module): Triton's response
allocator, response-complete and request-release callbacks copy each response out (outputs, error, parameters),
delete it, and queue a compact record, so no Python runs on Triton's threads and no GIL is taken there. One queue per
event loop; the loop watches its eventfd (`add_reader`) and drains every waiting record in one call, once per burst
(an engine step answers every running request within microseconds). Lifetimes, as tritonserver.h sets them, are
kept there too: the input buffers live until Triton releases the request, and the request object is deleted once it
is released AND its final response arrived (a decoupled backend may release a request and keep responding;
`cancel()` needs the request until its last response). The queue is bounded: when the loop falls behind, Triton's
response thread waits (backpressure on the backend), instead of memory growing without bound.

Outputs come back as Triton's bytes: `Response.flat()` gives each output as a flat list (BYTES elements as bytes,
numbers as Python numbers: no numpy), `Response.outputs` as numpy arrays (built on first use, for the KServe
front-ends' general tensors).
"""

from __future__ import annotations

import asyncio
import collections
import math
import struct
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving_image.triton.capi.errors import ErrorCode, TritonError

# TRITONSERVER_DataType, in tritonserver.h's order, with the numpy dtype of each (BYTES: length-prefixed elements).
DATATYPES = ("INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
             "FP32", "FP64", "BYTES", "BF16")
NUMPY_DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
                "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
                "FP32": np.float32, "FP64": np.float64}
_DTYPE_NAMES = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}
# memoryview.cast formats of the numeric datatypes (flat lists without numpy); FP16 is read through numpy
_CAST_FORMATS = {"BOOL": "?", "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT8": "b", "INT16": "h",
                 "INT32": "i", "INT64": "q", "FP32": "f", "FP64": "d"}
# How many records wait in a loop's queue before Triton's response thread waits for the loop.
QUEUE_CAPACITY = 1 << 16


@dataclass(frozen=True)
class Input:
    """One input tensor: Triton's datatype name, its shape and its content in Triton's layout."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray) -> Input:
        array = np.asarray(array)
        if array.dtype == np.object_ or array.dtype.kind in "SU":
            return cls.from_bytes(name, array.reshape(-1).tolist(), array.shape)
        datatype = _DTYPE_NAMES.get(array.dtype)
        if datatype is None:
            raise ValueError(f"input '{name}': numpy dtype {array.dtype} has no Triton datatype")
        return cls(name, datatype, tuple(array.shape), np.ascontiguousarray(array).tobytes())

    @classmethod
    def from_values(cls, name: str, datatype: str, shape: tuple[int, ...], values: Iterable[Any]) -> Input:
        """An input from its flat values in row-major order (bytes or str for BYTES, Python numbers or booleans
        otherwise), packed without numpy: the OpenAI front-end's few small tensors per request cost more through
        numpy arrays than their packing does."""
        if datatype == "BYTES":
            return cls.from_bytes(name, values, shape)
        fmt = _CAST_FORMATS.get(datatype)
        if fmt is None:  # FP16, BF16: numpy knows their layout
            return cls.from_numpy(name, np.array(list(values), dtype=NUMPY_DTYPES[datatype]).reshape(shape))
        values = list(values)
        if len(values) != math.prod(shape):
            raise ValueError(f"input '{name}': {len(values)} values for shape {list(shape)}")
        return cls(name, datatype, tuple(shape), struct.pack(f"<{len(values)}{fmt}", *values))

    @classmethod
    def from_bytes(cls, name: str, values: Iterable[bytes | str], shape: Iterable[int] | None = None) -> Input:
        """A BYTES tensor: each element a 4-byte little-endian length, then its bytes."""
        items = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]
        data = b"".join(struct.pack("<I", len(v)) + v for v in items)
        return cls(name, "BYTES", tuple(shape) if shape is not None else (len(items),), data)


def decode_bytes(raw: bytes, count: int | None = None) -> list[bytes]:
    out, pos = [], 0
    while pos + 4 <= len(raw) and (count is None or len(out) < count):
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        out.append(raw[pos:pos + length])
        pos += length
    return out


class Response:
    """One response, copied out of Triton: its outputs (name -> (datatype, shape, payload): BYTES elements as a list
    of bytes, other datatypes as Triton's raw bytes), the error (a response either has outputs or an error), the
    parameters, and whether it is the request's last response. A final response without a response object
    (decoupled models may end that way) has no outputs (`empty`)."""

    __slots__ = ("raw", "error", "final", "parameters", "empty", "_arrays")

    def __init__(self, raw: Mapping[str, tuple[str, tuple[int, ...], Any]] | None = None,
                 error: TritonError | None = None, final: bool = False, parameters: Mapping[str, Any] | None = None,
                 empty: bool = False):
        self.raw = dict(raw or {})
        self.error = error
        self.final = final
        self.parameters = dict(parameters or {})
        self.empty = empty
        self._arrays: dict[str, np.ndarray] | None = None

    def flat(self) -> dict[str, list]:
        """Each output as a flat list, without numpy."""
        out = {}
        for name, (datatype, _, payload) in self.raw.items():
            if datatype == "BYTES":
                out[name] = payload
            elif datatype in _CAST_FORMATS:
                out[name] = memoryview(payload).cast(_CAST_FORMATS[datatype]).tolist()
            else:
                out[name] = _array(name, datatype, (), payload).tolist()
        return out

    @property
    def outputs(self) -> dict[str, np.ndarray]:
        """Each output as a numpy array of its shape (BYTES as an object array of bytes)."""
        if self._arrays is None:
            self._arrays = {name: _array(name, datatype, shape, payload)
                            for name, (datatype, shape, payload) in self.raw.items()}
        return self._arrays


def _array(name: str, datatype: str, shape: tuple[int, ...], payload) -> np.ndarray:
    if datatype == "BYTES":
        array = np.empty(len(payload), dtype=np.object_)
        array[:] = payload
    elif datatype in NUMPY_DTYPES:
        array = np.frombuffer(payload, dtype=NUMPY_DTYPES[datatype]).copy()
    else:
        raise TritonError(ErrorCode.UNSUPPORTED, f"output '{name}': datatype {datatype} is not read by this binding")
    if shape and array.size == int(np.prod(shape, dtype=np.int64)):
        array = array.reshape(shape)
    return array


def _error(value) -> TritonError | None:
    if value is None:
        return None
    code, message = value
    try:
        return TritonError(ErrorCode(code), message)
    except ValueError:
        return TritonError(ErrorCode.UNKNOWN, message)


# -- the response path: one native queue per event loop ------------------------------------------------------------

_library = None
_library_lock = threading.Lock()


def native_library(lib):
    """The C API as the native module resolved it from the loaded libtritonserver (one per process): the response
    queues' and the C++ KServe gRPC front-end's."""
    global _library
    with _library_lock:
        if _library is None:
            from serving_image.triton.capi._response_path import Library

            _library = Library(str(lib.location.library))
        return _library


class _Delivery:
    """A native response queue and the streams it feeds, for one event loop: the loop drains the queue when its
    eventfd is readable and hands each record to its stream."""

    def __init__(self, lib, loop: asyncio.AbstractEventLoop):
        from serving_image.triton.capi._response_path import ResponseQueue

        self.loop = loop
        self.queue = ResponseQueue(native_library(lib), QUEUE_CAPACITY)
        self.streams: dict[int, InferenceStream] = {}
        loop.add_reader(self.queue.fd, self.drain)

    def drain(self) -> None:
        streams = self.streams
        for key, released, final, empty, error, outputs, parameters in self.queue.drain():
            stream = streams.get(key)
            if stream is None:  # its stream was given up (cancelled and closed): nothing waits for it
                continue
            if released:
                stream._on_released()
                if stream._finished:
                    del streams[key]
                continue
            raw = {name: (DATATYPES[datatype] if datatype < len(DATATYPES) else "INVALID", shape, payload)
                   for name, datatype, shape, payload in outputs}
            stream._on_response(Response(raw, _error(error), final, parameters, empty))
            if final and stream._released:
                del streams[key]


_deliveries: dict[int, _Delivery] = {}
_deliveries_lock = threading.Lock()


def _delivery(lib, loop: asyncio.AbstractEventLoop) -> _Delivery:
    with _deliveries_lock:
        delivery = _deliveries.get(id(loop))
        if delivery is None or delivery.loop is not loop:
            delivery = _deliveries[id(loop)] = _Delivery(lib, loop)
        return delivery


class InferenceStream:
    """The responses of one request, as an async iterator that ends after the final one. A response holding an
    error is yielded like any other (`response.error`); `cancel()` asks Triton to cancel the request (the backend
    sees it as cancelled; Triton's core answers CANCELLED to a request not yet scheduled)."""

    def __init__(self, delivery: _Delivery, key: int, request_id: str):
        self._delivery = delivery
        self._key = key
        self.request_id = request_id
        self.cancelled = False
        self._pending: collections.deque[Response] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._released_waiter: asyncio.Future | None = None
        self._finished = False  # the final response arrived
        self._released = False
        self._done = False  # the iterator handed out the final response

    def _on_response(self, response: Response) -> None:
        if response.final:
            self._finished = True
        self._pending.append(response)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_released(self) -> None:
        self._released = True
        if self._released_waiter is not None and not self._released_waiter.done():
            self._released_waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[Response]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Response]:
        while not self._done:
            while not self._pending:
                self._waiter = self._delivery.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            response = self._pending.popleft()
            if response.final:
                self._done = True
            yield response

    def ready(self) -> list[Response]:
        """Every response that has arrived and was not read yet (the iterator then goes on after them)."""
        taken = list(self._pending)
        self._pending.clear()
        if any(r.final for r in taken):
            self._done = True
        return taken

    @property
    def finished(self) -> bool:
        return self._finished

    async def wait_released(self) -> None:
        """Until Triton released the request (its inputs are no longer read; with the final response, the request
        object is deleted)."""
        if self._released:
            return
        if self._released_waiter is None:
            self._released_waiter = self._delivery.loop.create_future()
        await asyncio.shield(self._released_waiter)

    def cancel(self) -> bool:
        """Cancel the request in Triton; False when it already finished (nothing to cancel)."""
        from serving_image.triton.capi._response_path import CallError

        if self._finished:
            return False
        try:
            cancelled = self._delivery.queue.cancel(self._key)
        except CallError as exc:
            raise _error(exc.args) from None
        self.cancelled = self.cancelled or cancelled
        return cancelled


def _parameters(parameters: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    out = []
    for key, value in (parameters or {}).items():
        if not isinstance(value, bool | int | float | str):
            raise TypeError(f"parameter '{key}': {type(value).__name__} is not a Triton parameter type "
                            "(bool, int, float or str)")
        out.append((key, value))
    return out


def infer(server, model: str, inputs: Iterable[Input], *, request_id: str = "", version: int = -1,
          parameters: Mapping[str, Any] | None = None, outputs: Iterable[str] = (),
          loop: asyncio.AbstractEventLoop | None = None) -> InferenceStream:
    """Send one request (TRITONSERVER_ServerInferAsync) and return its responses as an InferenceStream. Errors
    Triton raises before accepting the request (unknown model, wrong datatype or shape, ...) are raised here as
    TritonError; errors found later arrive as a response's `error`."""
    from serving_image.triton.capi._response_path import CallError

    loop = loop or asyncio.get_running_loop()
    delivery = _delivery(server.lib, loop)
    native_inputs = []
    for tensor in inputs:
        if tensor.datatype not in DATATYPES[1:]:
            raise TritonError(ErrorCode.INVALID_ARG, f"input '{tensor.name}': unknown datatype {tensor.datatype}")
        native_inputs.append((tensor.name, DATATYPES.index(tensor.datatype), tensor.shape, tensor.data))
    try:
        key = delivery.queue.submit(server.handle.value, model, version, request_id, native_inputs, list(outputs),
                                    _parameters(parameters))
    except CallError as exc:
        raise _error(exc.args) from None
    stream = InferenceStream(delivery, key, request_id)
    delivery.streams[key] = stream  # on the loop's thread: no record of it can be drained before this
    return stream
