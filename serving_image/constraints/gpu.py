"""The GPU path of the bitmask apply: the fused CUDA kernel (native/src/mask_kernel.cu) through its C ABI.

The kernel library `_mask_cuda.so` is built by the package build when nvcc is present (native/CMakeLists.txt; the
image builds it in its CUDA stage) and installed next to this module. Per step the host packs the rows' bitmask
words into pinned memory, one asynchronous copy moves them to the device and one kernel masks the logits and
rescues rows left with nothing to sample, all queued on torch's current stream: the host never waits for the GPU.

Which path masks CUDA logits is chosen once per process by `LLM_SERVING_CONSTRAINT_CUDA`:
  - `auto` (default): the kernel; when it cannot be loaded, torch operations, with an error in the log that says
    why and what it costs (never silently);
  - `require`: the kernel or a `KernelUnavailable` error (the processor then fails at its first GPU step);
  - `torch`: torch operations on purpose (benchmarks, diagnosis).
`LLM_SERVING_CONSTRAINT_CUDA_LIB` points at another build of the library (tests, benchmarks).

The module imports no torch at import time and needs no GPU for its host-side helpers (`HostLogic`): the tests load
a freshly built library and check its validation, launch plan and kernel emulation on the CPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

LIBRARY_NAME = "_mask_cuda.so"
LIBRARY_ENV = "LLM_SERVING_CONSTRAINT_CUDA_LIB"
MODE_ENV = "LLM_SERVING_CONSTRAINT_CUDA"
MODES = ("auto", "require", "torch")
ABI_VERSION = 1
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
PLAN_FIELDS = ("block_threads", "chunk_cols", "chunks_per_row", "grid_blocks", "mask_words", "header_bytes",
               "staging_bytes")
_ERR_LEN = 512

_i32p = ctypes.POINTER(ctypes.c_int32)
_u32p = ctypes.POINTER(ctypes.c_uint32)


class KernelUnavailable(RuntimeError):
    """The GPU bitmask kernel cannot be used (not built, no driver, no device); the message says which."""


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def library_path() -> Path:
    """Where the kernel library is: $LLM_SERVING_CONSTRAINT_CUDA_LIB, else next to this package's modules."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return Path(override)
    from serving_image import constraints

    candidates = [Path(p) / LIBRARY_NAME for p in constraints.__path__]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise KernelUnavailable(
        f"{LIBRARY_NAME} was not built (looked in {', '.join(str(c.parent) for c in candidates)}): the package build "
        "found no nvcc (native/CMakeLists.txt says so in the build log)"
    )


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    lib.lsm_abi_version.restype = c.c_int
    lib.lsm_plan.argtypes = [c.c_int64, c.c_int32, c.c_int32, c.POINTER(c.c_int64)]
    lib.lsm_plan.restype = None
    lib.lsm_validate.argtypes = [c.c_int64, c.c_int32, c.c_int64, c.c_int32, c.c_int32, c.c_int32, _i32p, _i32p,
                                 c.c_int64, c.c_char_p, c.c_size_t]
    lib.lsm_validate.restype = c.c_int
    lib.lsm_emulate.argtypes = [c.c_void_p, c.c_int64, c.c_int32, c.c_int64, c.c_int32, _u32p, c.c_int32, c.c_int32,
                                _i32p, _i32p, c.c_int64, c.c_int32, c.c_char_p, c.c_size_t]
    lib.lsm_emulate.restype = c.c_int64
    lib.lsm_create.argtypes = [c.c_int, c.c_char_p, c.c_size_t]
    lib.lsm_create.restype = c.c_void_p
    lib.lsm_destroy.argtypes = [c.c_void_p]
    lib.lsm_destroy.restype = None
    lib.lsm_error.argtypes = [c.c_void_p]
    lib.lsm_error.restype = c.c_char_p
    lib.lsm_sm_count.argtypes = [c.c_void_p]
    lib.lsm_sm_count.restype = c.c_int
    lib.lsm_apply.argtypes = [c.c_void_p, c.c_void_p, c.c_int64, c.c_int32, c.c_int64, c.c_int32, _u32p, c.c_int32,
                              c.c_int32, _i32p, _i32p, c.c_int64, c.c_size_t]
    lib.lsm_apply.restype = c.c_int
    lib.lsm_rescued.argtypes = [c.c_void_p]
    lib.lsm_rescued.restype = c.c_int64
    return lib


_libraries: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


def load_library(path: Path | str | None = None) -> ctypes.CDLL:
    """The kernel library (loaded once per path); KernelUnavailable when it is missing or from another ABI."""
    path = Path(path) if path is not None else library_path()
    key = str(path.resolve())
    with _lock:
        if key in _libraries:
            return _libraries[key]
        try:
            lib = _declare(ctypes.CDLL(key))
        except OSError as exc:
            raise KernelUnavailable(f"{path}: cannot be loaded: {exc}") from exc
        if lib.lsm_abi_version() != ABI_VERSION:
            raise KernelUnavailable(f"{path}: ABI {lib.lsm_abi_version()}, this module speaks {ABI_VERSION}: rebuild")
        _libraries[key] = lib
        return lib


def _rows(values) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int32).reshape(-1))


def _words(bitmask: np.ndarray) -> np.ndarray:
    if bitmask.ndim != 2 or not bitmask.flags.c_contiguous or bitmask.dtype.itemsize != 4:
        raise ValueError("bitmask: a C-contiguous 2-D array of 32-bit words expected")
    return bitmask.view(np.uint32)


class HostLogic:
    """The library's host-side entry points, which need no GPU: validation, launch plan, kernel emulation."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def plan(self, n: int, ncols: int, sm_count: int) -> dict[str, int]:
        out = (ctypes.c_int64 * len(PLAN_FIELDS))()
        self.lib.lsm_plan(n, ncols, sm_count, out)
        return dict(zip(PLAN_FIELDS, out, strict=True))

    def validate(self, nrows: int, ncols: int, row_stride: int, dtype: str, words: int, mask_capacity: int,
                 logit_rows, mask_rows) -> str:
        lr, mr = _rows(logit_rows), _rows(mask_rows)
        if len(lr) != len(mr):
            return "logit_rows/mask_rows: lengths differ"
        err = ctypes.create_string_buffer(_ERR_LEN)
        self.lib.lsm_validate(nrows, ncols, row_stride, DTYPE_CODES.get(dtype, -1), words, mask_capacity,
                              lr.ctypes.data_as(_i32p), mr.ctypes.data_as(_i32p), len(lr), err, _ERR_LEN)
        return err.value.decode()

    def emulate(self, logits: np.ndarray, dtype: str, bitmask: np.ndarray, logit_rows, mask_rows,
                sm_count: int) -> int:
        """Run the kernel's blocks on the host over `logits` (a 2-D array of raw 32- or 16-bit values, in place)."""
        lr, mr, words = _rows(logit_rows), _rows(mask_rows), _words(bitmask)
        err = ctypes.create_string_buffer(_ERR_LEN)
        rescued = self.lib.lsm_emulate(
            logits.ctypes.data, logits.shape[0], logits.shape[1], logits.strides[0] // logits.itemsize,
            DTYPE_CODES[dtype], words.ctypes.data_as(_u32p), words.shape[1], words.shape[0],
            lr.ctypes.data_as(_i32p), mr.ctypes.data_as(_i32p), len(lr), sm_count, err, _ERR_LEN)
        if rescued < 0:
            raise ValueError(err.value.decode())
        return rescued


class GpuMaskApplier:
    """One CUDA device's kernel handle: pinned staging buffers, device workspace, the rescue counter."""

    def __init__(self, device_index: int, lib: ctypes.CDLL | None = None):
        self.lib = lib if lib is not None else load_library()
        err = ctypes.create_string_buffer(_ERR_LEN)
        handle = self.lib.lsm_create(device_index, err, _ERR_LEN)
        if not handle:
            raise KernelUnavailable(f"CUDA device {device_index}: {err.value.decode()}")
        self.handle = handle
        self.device_index = device_index
        self.sm_count = self.lib.lsm_sm_count(handle)

    def apply(self, logits: torch.Tensor, bitmask: np.ndarray, logit_rows, mask_rows) -> None:
        """Queue the masking of logits[logit_rows[i]] by bitmask[mask_rows[i]] on torch's current stream."""
        import torch

        if not self.handle:
            raise RuntimeError("GPU bitmask apply: the handle is closed")
        dtype = str(logits.dtype).removeprefix("torch.")
        if logits.dim() != 2 or logits.stride(1) != 1 or dtype not in DTYPE_CODES:
            raise ValueError(f"logits: 2-D, unit column stride, float32/bfloat16/float16 expected, got "
                             f"{tuple(logits.shape)} {dtype} strides {logits.stride()}")
        lr, mr, words = _rows(logit_rows), _rows(mask_rows), _words(bitmask)
        if len(lr) != len(mr):
            raise ValueError("logit_rows and mask_rows differ in length")
        stream = torch.cuda.current_stream(logits.device).cuda_stream
        rc = self.lib.lsm_apply(self.handle, logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                                DTYPE_CODES[dtype], words.ctypes.data_as(_u32p), words.shape[1], words.shape[0],
                                lr.ctypes.data_as(_i32p), mr.ctypes.data_as(_i32p), len(lr), stream)
        if rc != 0:
            raise RuntimeError(f"GPU bitmask apply: {self.lib.lsm_error(self.handle).decode()}")

    def rescued(self) -> int:
        """Rows rescued so far; waits for the queued launches (diagnostics only)."""
        if not self.handle:
            raise RuntimeError("GPU bitmask apply: the handle is closed")
        return int(self.lib.lsm_rescued(self.handle))

    def close(self) -> None:
        """Free the handle's device and pinned memory (tests, benchmarks). The processor's appliers live as long as
        the process; they are not freed at interpreter exit, when the CUDA runtime may be unloading already."""
        if self.handle:
            self.lib.lsm_destroy(self.handle)
            self.handle = None


def kernel_accepts(logits: torch.Tensor) -> bool:
    """Whether the kernel can mask these logits in place (2-D, unit column stride, float32/bfloat16/float16); the
    torch path takes the rest, said once in the log."""
    dtype = str(logits.dtype).removeprefix("torch.")
    if logits.dim() == 2 and logits.stride(1) == 1 and dtype in DTYPE_CODES:
        return True
    _warn_once(f"layout {dtype} {logits.dim()}", f"logits of {dtype}, {logits.dim()}-D, strides {logits.stride()}: "
                                                 "not a layout the GPU kernel takes, masked with torch operations",
               level=logging.WARNING)
    return False


_appliers: dict[int, GpuMaskApplier] = {}
_warned: set[str] = set()


def applier_for(device: torch.device) -> GpuMaskApplier | None:
    """The kernel for a CUDA device, or None where the torch path must be used (said loudly, once per reason)."""
    chosen = mode()
    if chosen == "torch":
        _warn_once("torch", "LLM_SERVING_CONSTRAINT_CUDA=torch: constrained rows are masked with torch operations, "
                            "not the fused kernel (chosen on purpose)", level=logging.WARNING)
        return None
    index = device.index if device.index is not None else _current_device()
    with _lock:
        hit = _appliers.get(index)
    if hit is not None:
        return hit
    try:
        applier = GpuMaskApplier(index)
    except KernelUnavailable as exc:
        if chosen == "require":
            raise
        _warn_once(str(exc), f"the GPU bitmask kernel is NOT used: {exc}. Constrained rows are masked with torch "
                             "operations instead (several launches and a device-side unpack per step, slower); "
                             f"set {MODE_ENV}=require to fail instead, or {MODE_ENV}=torch to choose this on purpose")
        return None
    with _lock:
        return _appliers.setdefault(index, applier)


def _current_device() -> int:
    import torch

    return torch.cuda.current_device()


def _warn_once(key: str, message: str, level: int = logging.ERROR) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.log(level, "constraint processor: %s", message)
