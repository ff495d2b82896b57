"""Inference through the C API: a request's inputs, parameters and requested outputs; output buffers from one
process-wide response allocator (host memory); responses delivered into asyncio; cancellation.

Lifetimes, as tritonserver.h sets them:
- the input buffers must stay valid until Triton releases the request (its release callback): the request's state
  keeps them referenced;
- the request object is deleted here once Triton released it AND its final response arrived, never before: a
  decoupled backend may release the request and keep sending responses, and `cancel()` needs the request object
  until the last response (TRITONSERVER_InferenceRequestCancel reaches the backend through it);
- each response is read in the callback's thread (outputs copied out, the error's code and message, the parameters)
  and deleted there, and only Python values cross into the event loop (`loop.call_soon_threadsafe`).

The callbacks are ctypes function pointers kept referenced at module level; a request reaches its Python state
through an integer key passed as Triton's `userp`.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import struct
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from ctypes import POINTER, c_bool, c_char_p, c_double, c_int, c_int64, c_size_t, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving_image.triton.capi.errors import ErrorCode, TritonError, check, read_error
from serving_image.triton.capi.library import (
    Ptr,
    RequestReleaseFn,
    ResponseAllocatorAllocFn,
    ResponseAllocatorReleaseFn,
    ResponseCompleteFn,
)

log = logging.getLogger(__name__)

MEMORY_CPU = 0
REQUEST_RELEASE_ALL = 1
RESPONSE_COMPLETE_FINAL = 1
PARAMETER_STRING, PARAMETER_INT, PARAMETER_BOOL, PARAMETER_DOUBLE, PARAMETER_BYTES = range(5)

# TRITONSERVER_DataType, in tritonserver.h's order, with the numpy dtype of each (BYTES: length-prefixed elements).
DATATYPES = ("INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
             "FP32", "FP64", "BYTES", "BF16")
NUMPY_DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
                "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
                "FP32": np.float32, "FP64": np.float64}
_DTYPE_NAMES = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}


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


@dataclass(frozen=True)
class Response:
    """One response, copied out of Triton: outputs as numpy arrays (BYTES as object arrays of bytes), the error (a
    response either has outputs or an error), the parameters, and whether it is the request's last response. A
    final response without a response object (decoupled models may end that way) has no outputs."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    error: TritonError | None = None
    final: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)
    empty: bool = False  # the final flag arrived alone (no response object)


def _read_response(lib, response: Ptr, flags: int) -> Response:
    final = bool(flags & RESPONSE_COMPLETE_FINAL)
    if not response:
        return Response(final=final, empty=True)
    try:
        error_ptr = lib.TRITONSERVER_InferenceResponseError(response)
        error = read_error(lib, error_ptr) if error_ptr else None  # owned by the response: not deleted here
        parameters: dict[str, Any] = {}
        count = c_uint32()
        check(lib, lib.TRITONSERVER_InferenceResponseParameterCount(response, ctypes.byref(count)))
        for index in range(count.value):
            name, kind, value = c_char_p(), c_int(), c_void_p()
            check(lib, lib.TRITONSERVER_InferenceResponseParameter(response, index, ctypes.byref(name),
                                                                   ctypes.byref(kind), ctypes.byref(value)))
            key = name.value.decode()
            if kind.value == PARAMETER_STRING:
                parameters[key] = ctypes.cast(value, c_char_p).value.decode("utf-8", "replace")
            elif kind.value == PARAMETER_INT:
                parameters[key] = ctypes.cast(value, POINTER(c_int64)).contents.value
            elif kind.value == PARAMETER_BOOL:
                parameters[key] = ctypes.cast(value, POINTER(c_bool)).contents.value
            elif kind.value == PARAMETER_DOUBLE:
                parameters[key] = ctypes.cast(value, POINTER(c_double)).contents.value
        outputs: dict[str, np.ndarray] = {}
        check(lib, lib.TRITONSERVER_InferenceResponseOutputCount(response, ctypes.byref(count)))
        for index in range(count.value):
            name, datatype, shape, dims = c_char_p(), c_int(), POINTER(c_int64)(), c_uint64()
            base, size, memory, memory_id, userp = c_void_p(), c_size_t(), c_int(), c_int64(), c_void_p()
            check(lib, lib.TRITONSERVER_InferenceResponseOutput(
                response, index, ctypes.byref(name), ctypes.byref(datatype), ctypes.byref(shape), ctypes.byref(dims),
                ctypes.byref(base), ctypes.byref(size), ctypes.byref(memory), ctypes.byref(memory_id),
                ctypes.byref(userp)))
            dims_tuple = tuple(shape[i] for i in range(dims.value))
            raw = ctypes.string_at(base, size.value) if size.value else b""
            type_name = DATATYPES[datatype.value] if datatype.value < len(DATATYPES) else "INVALID"
            if type_name == "BYTES":
                items = decode_bytes(raw)
                array = np.empty(len(items), dtype=np.object_)
                array[:] = items
            elif type_name in NUMPY_DTYPES:
                array = np.frombuffer(raw, dtype=NUMPY_DTYPES[type_name]).copy()
            else:
                raise TritonError(ErrorCode.UNSUPPORTED, f"output '{name.value.decode()}': datatype {type_name} "
                                  "is not read by this binding")
            if array.size == int(np.prod(dims_tuple, dtype=np.int64)):
                array = array.reshape(dims_tuple)
            outputs[name.value.decode()] = array
        return Response(outputs=outputs, error=error, final=final, parameters=parameters)
    finally:
        lib.TRITONSERVER_InferenceResponseDelete(response)


# -- the response allocator: host memory from libc's malloc, freed when Triton releases the buffer ---------------

_libc = ctypes.CDLL(None)
_libc.malloc.restype = c_void_p
_libc.malloc.argtypes = [c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [c_void_p]


@ResponseAllocatorAllocFn
def _alloc(allocator, tensor_name, byte_size, memory_type, memory_type_id, userp, buffer, buffer_userp,
           actual_memory_type, actual_memory_type_id):
    buffer[0] = _libc.malloc(byte_size) if byte_size else None
    buffer_userp[0] = None
    actual_memory_type[0] = MEMORY_CPU
    actual_memory_type_id[0] = 0
    if byte_size and not buffer[0]:
        return _lib_for_callbacks.TRITONSERVER_ErrorNew(int(ErrorCode.INTERNAL),
                                                        f"out of memory for {byte_size} bytes".encode())
    return None


@ResponseAllocatorReleaseFn
def _release_buffer(allocator, buffer, buffer_userp, byte_size, memory_type, memory_type_id):
    if buffer:
        _libc.free(buffer)
    return None


_lib_for_callbacks = None
_allocator: Ptr | None = None
_allocator_lock = threading.Lock()


def _response_allocator(lib) -> Ptr:
    global _allocator, _lib_for_callbacks
    with _allocator_lock:
        if _allocator is None:
            _lib_for_callbacks = lib
            allocator = Ptr()
            check(lib, lib.TRITONSERVER_ResponseAllocatorNew(ctypes.byref(allocator), _alloc, _release_buffer, None))
            _allocator = allocator
        return _allocator


# -- requests in flight ---------------------------------------------------------------------------------------

_states: dict[int, _RequestState] = {}
_keys = itertools.count(1)
_states_lock = threading.Lock()


class _RequestState:
    def __init__(self, lib, request: Ptr, loop: asyncio.AbstractEventLoop, keep: list):
        self.lib = lib
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Response] = asyncio.Queue()
        self.keep = keep  # input buffers and names: valid until the request is released
        self.lock = threading.Lock()
        self.released = False
        self.released_event = asyncio.Event()  # set in the loop once Triton released the request
        self.final = False
        self.deleted = False
        self.key = 0

    def _maybe_delete(self) -> None:
        """Under self.lock: delete the request once it is released and its final response has arrived."""
        if self.released and self.final and not self.deleted:
            self.deleted = True
            self.lib.TRITONSERVER_InferenceRequestDelete(self.request)
            self.keep = []
            with _states_lock:
                _states.pop(self.key, None)

    def deliver(self, response: Response) -> None:
        _dispatcher(self.loop).post(self.queue.put_nowait, response)


class _Dispatcher:
    """Hands callbacks from Triton's threads to one event loop, waking the loop once per burst instead of once per
    response: an engine step answers every running request within microseconds, and each wake-up is a syscall and a
    GIL hand-over (what dominated the front-end's CPU time when each response woke the loop on its own)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[Any, Any]] = []

    def post(self, function, argument) -> None:
        with self.lock:
            self.pending.append((function, argument))
            if len(self.pending) > 1:
                return  # a wake-up is already on its way and will run this too
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self.lock:
                self.pending.clear()

    def _run(self) -> None:
        with self.lock:
            batch, self.pending = self.pending, []
        for function, argument in batch:
            function(argument)


_dispatchers: dict[int, _Dispatcher] = {}
_dispatchers_lock = threading.Lock()


def _dispatcher(loop: asyncio.AbstractEventLoop) -> _Dispatcher:
    with _dispatchers_lock:
        dispatcher = _dispatchers.get(id(loop))
        if dispatcher is None or dispatcher.loop is not loop:
            dispatcher = _dispatchers[id(loop)] = _Dispatcher(loop)
        return dispatcher


@RequestReleaseFn
def _on_request_release(request, flags, userp):
    with _states_lock:
        state = _states.get(userp or 0)
    if state is None or not flags & REQUEST_RELEASE_ALL:
        return
    with state.lock:
        state.released = True
        state._maybe_delete()
    _dispatcher(state.loop).post(lambda event: event.set(), state.released_event)


@ResponseCompleteFn
def _on_response(response, flags, userp):
    with _states_lock:
        state = _states.get(userp or 0)
    if state is None:  # cannot happen while the request is registered; never leak the response
        if response:
            _lib_for_callbacks.TRITONSERVER_InferenceResponseDelete(response)
        return
    try:
        item = _read_response(state.lib, response, flags)
    except Exception as exc:  # a response this binding cannot read: an error response for the caller
        item = Response(error=TritonError(ErrorCode.INTERNAL, f"reading a response failed: {exc!r}"),
                        final=bool(flags & RESPONSE_COMPLETE_FINAL))
    if flags & RESPONSE_COMPLETE_FINAL:  # before the caller can see the final response
        with state.lock:
            state.final = True
            state._maybe_delete()
    state.deliver(item)


class InferenceStream:
    """The responses of one request, as an async iterator that ends after the final one. A response holding an
    error is yielded like any other (`response.error`); `cancel()` asks Triton to cancel the request (the backend
    sees it as cancelled; Triton's core answers CANCELLED to a request not yet scheduled)."""

    def __init__(self, state: _RequestState, request_id: str):
        self._state = state
        self.request_id = request_id
        self.cancelled = False
        self._done = False

    def __aiter__(self) -> AsyncIterator[Response]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Response]:
        while not self._done:
            response = await self._state.queue.get()
            if response.final:
                self._done = True
            yield response

    @property
    def finished(self) -> bool:
        return self._state.final

    async def wait_released(self) -> None:
        """Until Triton released the request (its inputs are no longer read; with the final response, the request
        object is deleted)."""
        await self._state.released_event.wait()

    def cancel(self) -> bool:
        """Cancel the request in Triton; False when it already finished (nothing to cancel)."""
        state = self._state
        with state.lock:
            if state.deleted or state.final:
                return False
            self.cancelled = True
            check(state.lib, state.lib.TRITONSERVER_InferenceRequestCancel(state.request))
            return True


def _set_parameter(lib, request: Ptr, key: str, value: Any) -> None:
    name = key.encode()
    if isinstance(value, bool):
        check(lib, lib.TRITONSERVER_InferenceRequestSetBoolParameter(request, name, value))
    elif isinstance(value, int):
        check(lib, lib.TRITONSERVER_InferenceRequestSetIntParameter(request, name, value))
    elif isinstance(value, float):
        check(lib, lib.TRITONSERVER_InferenceRequestSetDoubleParameter(request, name, value))
    elif isinstance(value, str):
        check(lib, lib.TRITONSERVER_InferenceRequestSetStringParameter(request, name, value.encode()))
    else:
        raise TypeError(f"parameter '{key}': {type(value).__name__} is not a Triton parameter type "
                        "(bool, int, float or str)")


def infer(server, model: str, inputs: Iterable[Input], *, request_id: str = "", version: int = -1,
          parameters: Mapping[str, Any] | None = None, outputs: Iterable[str] = (),
          loop: asyncio.AbstractEventLoop | None = None) -> InferenceStream:
    """Send one request (TRITONSERVER_ServerInferAsync) and return its responses as an InferenceStream. Errors
    Triton raises before accepting the request (unknown model, wrong datatype or shape, ...) are raised here as
    TritonError; errors found later arrive as a response's `error`."""
    lib = server.lib
    loop = loop or asyncio.get_running_loop()
    allocator = _response_allocator(lib)
    request = Ptr()
    check(lib, lib.TRITONSERVER_InferenceRequestNew(ctypes.byref(request), server.handle, model.encode(), version))
    keep: list = []
    state = _RequestState(lib, request, loop, keep)
    try:
        if request_id:
            check(lib, lib.TRITONSERVER_InferenceRequestSetId(request, request_id.encode()))
        for tensor in inputs:
            if tensor.datatype not in DATATYPES[1:]:
                raise TritonError(ErrorCode.INVALID_ARG, f"input '{tensor.name}': unknown datatype {tensor.datatype}")
            name = tensor.name.encode()
            shape = (c_int64 * len(tensor.shape))(*tensor.shape)
            check(lib, lib.TRITONSERVER_InferenceRequestAddInput(request, name, DATATYPES.index(tensor.datatype),
                                                                 shape, len(tensor.shape)))
            keep.append(tensor.data)
            check(lib, lib.TRITONSERVER_InferenceRequestAppendInputData(request, name, tensor.data, len(tensor.data),
                                                                        MEMORY_CPU, 0))
        for output in outputs:
            check(lib, lib.TRITONSERVER_InferenceRequestAddRequestedOutput(request, output.encode()))
        for key, value in (parameters or {}).items():
            _set_parameter(lib, request, key, value)
        with _states_lock:
            state.key = next(_keys)
            _states[state.key] = state
        check(lib, lib.TRITONSERVER_InferenceRequestSetReleaseCallback(request, _on_request_release, state.key))
        check(lib, lib.TRITONSERVER_InferenceRequestSetResponseCallback(request, allocator, None, _on_response,
                                                                        state.key))
        check(lib, lib.TRITONSERVER_ServerInferAsync(server.handle, request, None))
    except BaseException:
        with _states_lock:
            _states.pop(state.key, None)
        lib.TRITONSERVER_InferenceRequestDelete(request)  # not taken by Triton: still ours
        raise
    return InferenceStream(state, request_id)


def in_flight() -> int:
    """Requests sent and not yet both released and finished (a leak check for the tests)."""
    with _states_lock:
        return len(_states)
