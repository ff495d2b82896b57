"""Find libtritonserver.so, load it, and declare the C signatures this binding calls (tritonserver.h).

Where the library is:
- `$LLM_SERVING_TRITON_LIBRARY` when set (a path to libtritonserver*.so);
- in the image (`LLM_SERVING_RUNTIME=triton`): the Triton release's `/opt/tritonserver/lib/libtritonserver.so`;
- locally: nvidia-pytriton's `nvidia_pytriton.libs/libtritonserver-*.so` (serving_image/triton/local_install.py).

The library's dependencies (libcurl, libssl, libdcgm, ... under renamed sonames) live in its own folder, which its
RUNPATH covers for direct dependencies only: their own dependencies (libnghttp2, ...) are found through the loader's
path. The startup procedure therefore re-executes itself with that folder on `LD_LIBRARY_PATH` before anything is
loaded (serving_image/triton/embedded.py, `reexec_with_loader_path`). A process started otherwise (a test, a
script) gets the same result from `load_library`: it loads each missing dependency by its path from that folder
first (the dynamic loader then matches them by soname), and puts the folder on `LD_LIBRARY_PATH` for the child
processes Triton starts (the Python backend's stub). When the folder is missing or a dependency is not in it,
TritonLibraryError says which file and where it was looked for.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from ctypes import POINTER, c_bool, c_char_p, c_double, c_int, c_int64, c_size_t, c_uint, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from pathlib import Path

LIBRARY_ENV = "LLM_SERVING_TRITON_LIBRARY"
IMAGE_LIBRARY = Path("/opt/tritonserver/lib/libtritonserver.so")
API_MAJOR = 1
API_MINOR_MIN = 17  # TRITONSERVER_InferenceRequestCancel and the CANCELLED code arrived in 1.2x; 2.51 reports 1.34

_MISSING = re.compile(r"^([^:]+): cannot open shared object file")


class TritonLibraryError(RuntimeError):
    """libtritonserver.so cannot be found or loaded; the message says what is missing and what to do."""


# Opaque handles: every TRITONSERVER_* object is a pointer the binding never dereferences.
Ptr = c_void_p
ResponseAllocatorAllocFn = ctypes.CFUNCTYPE(Ptr, Ptr, c_char_p, c_size_t, c_int, c_int64, Ptr, POINTER(Ptr),
                                            POINTER(Ptr), POINTER(c_int), POINTER(c_int64))
ResponseAllocatorReleaseFn = ctypes.CFUNCTYPE(Ptr, Ptr, Ptr, Ptr, c_size_t, c_int, c_int64)
RequestReleaseFn = ctypes.CFUNCTYPE(None, Ptr, c_uint32, Ptr)
ResponseCompleteFn = ctypes.CFUNCTYPE(None, Ptr, c_uint32, Ptr)

_ERR = Ptr  # TRITONSERVER_Error*: NULL on success
# name: (restype, argtypes). Enums are C ints.
_SIGNATURES: dict[str, tuple] = {
    "TRITONSERVER_ApiVersion": (_ERR, [POINTER(c_uint32), POINTER(c_uint32)]),
    # errors
    "TRITONSERVER_ErrorNew": (Ptr, [c_int, c_char_p]),
    "TRITONSERVER_ErrorDelete": (None, [Ptr]),
    "TRITONSERVER_ErrorCode": (c_int, [Ptr]),
    "TRITONSERVER_ErrorCodeString": (c_char_p, [Ptr]),
    "TRITONSERVER_ErrorMessage": (c_char_p, [Ptr]),
    # messages (JSON) and metrics
    "TRITONSERVER_MessageSerializeToJson": (_ERR, [Ptr, POINTER(c_void_p), POINTER(c_size_t)]),
    "TRITONSERVER_MessageDelete": (_ERR, [Ptr]),
    "TRITONSERVER_MetricsFormatted": (_ERR, [Ptr, c_int, POINTER(c_void_p), POINTER(c_size_t)]),
    "TRITONSERVER_MetricsDelete": (_ERR, [Ptr]),
    # server options
    "TRITONSERVER_ServerOptionsNew": (_ERR, [POINTER(Ptr)]),
    "TRITONSERVER_ServerOptionsDelete": (_ERR, [Ptr]),
    "TRITONSERVER_ServerOptionsSetServerId": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerOptionsSetModelRepositoryPath": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerOptionsSetModelControlMode": (_ERR, [Ptr, c_int]),
    "TRITONSERVER_ServerOptionsSetStartupModel": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerOptionsSetStrictModelConfig": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetStrictReadiness": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetExitOnError": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetExitTimeout": (_ERR, [Ptr, c_uint]),
    "TRITONSERVER_ServerOptionsSetBackendDirectory": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerOptionsSetRepoAgentDirectory": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerOptionsSetBackendConfig": (_ERR, [Ptr, c_char_p, c_char_p, c_char_p]),
    "TRITONSERVER_ServerOptionsSetLogInfo": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetLogWarn": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetLogError": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetLogVerbose": (_ERR, [Ptr, c_int]),
    "TRITONSERVER_ServerOptionsSetLogFile": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerOptionsSetMetrics": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetGpuMetrics": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetCpuMetrics": (_ERR, [Ptr, c_bool]),
    "TRITONSERVER_ServerOptionsSetMetricsConfig": (_ERR, [Ptr, c_char_p, c_char_p, c_char_p]),
    "TRITONSERVER_ServerOptionsSetMinSupportedComputeCapability": (_ERR, [Ptr, c_double]),
    "TRITONSERVER_ServerOptionsSetPinnedMemoryPoolByteSize": (_ERR, [Ptr, c_uint64]),
    # server
    "TRITONSERVER_ServerNew": (_ERR, [POINTER(Ptr), Ptr]),
    "TRITONSERVER_ServerDelete": (_ERR, [Ptr]),
    "TRITONSERVER_ServerStop": (_ERR, [Ptr]),
    "TRITONSERVER_ServerIsLive": (_ERR, [Ptr, POINTER(c_bool)]),
    "TRITONSERVER_ServerIsReady": (_ERR, [Ptr, POINTER(c_bool)]),
    "TRITONSERVER_ServerModelIsReady": (_ERR, [Ptr, c_char_p, c_int64, POINTER(c_bool)]),
    "TRITONSERVER_ServerModelTransactionProperties": (_ERR, [Ptr, c_char_p, c_int64, POINTER(c_uint32),
                                                             POINTER(c_void_p)]),
    "TRITONSERVER_ServerMetadata": (_ERR, [Ptr, POINTER(Ptr)]),
    "TRITONSERVER_ServerModelMetadata": (_ERR, [Ptr, c_char_p, c_int64, POINTER(Ptr)]),
    "TRITONSERVER_ServerModelStatistics": (_ERR, [Ptr, c_char_p, c_int64, POINTER(Ptr)]),
    "TRITONSERVER_ServerModelConfig": (_ERR, [Ptr, c_char_p, c_int64, c_uint32, POINTER(Ptr)]),
    "TRITONSERVER_ServerModelIndex": (_ERR, [Ptr, c_uint32, POINTER(Ptr)]),
    "TRITONSERVER_ServerLoadModel": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerUnloadModel": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_ServerMetrics": (_ERR, [Ptr, POINTER(Ptr)]),
    "TRITONSERVER_ServerInferAsync": (_ERR, [Ptr, Ptr, Ptr]),
    # response allocator
    "TRITONSERVER_ResponseAllocatorNew": (_ERR, [POINTER(Ptr), ResponseAllocatorAllocFn,
                                                 ResponseAllocatorReleaseFn, Ptr]),
    "TRITONSERVER_ResponseAllocatorDelete": (_ERR, [Ptr]),
    # inference requests
    "TRITONSERVER_InferenceRequestNew": (_ERR, [POINTER(Ptr), Ptr, c_char_p, c_int64]),
    "TRITONSERVER_InferenceRequestDelete": (_ERR, [Ptr]),
    "TRITONSERVER_InferenceRequestSetId": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_InferenceRequestAddInput": (_ERR, [Ptr, c_char_p, c_int, POINTER(c_int64), c_uint64]),
    "TRITONSERVER_InferenceRequestAppendInputData": (_ERR, [Ptr, c_char_p, c_void_p, c_size_t, c_int, c_int64]),
    "TRITONSERVER_InferenceRequestAddRequestedOutput": (_ERR, [Ptr, c_char_p]),
    "TRITONSERVER_InferenceRequestSetStringParameter": (_ERR, [Ptr, c_char_p, c_char_p]),
    "TRITONSERVER_InferenceRequestSetIntParameter": (_ERR, [Ptr, c_char_p, c_int64]),
    "TRITONSERVER_InferenceRequestSetBoolParameter": (_ERR, [Ptr, c_char_p, c_bool]),
    "TRITONSERVER_InferenceRequestSetDoubleParameter": (_ERR, [Ptr, c_char_p, c_double]),
    "TRITONSERVER_InferenceRequestSetReleaseCallback": (_ERR, [Ptr, RequestReleaseFn, Ptr]),
    "TRITONSERVER_InferenceRequestSetResponseCallback": (_ERR, [Ptr, Ptr, Ptr, ResponseCompleteFn, Ptr]),
    "TRITONSERVER_InferenceRequestCancel": (_ERR, [Ptr]),
    "TRITONSERVER_InferenceRequestIsCancelled": (_ERR, [Ptr, POINTER(c_bool)]),
    # inference responses
    "TRITONSERVER_InferenceResponseDelete": (_ERR, [Ptr]),
    "TRITONSERVER_InferenceResponseError": (Ptr, [Ptr]),
    "TRITONSERVER_InferenceResponseId": (_ERR, [Ptr, POINTER(c_char_p)]),
    "TRITONSERVER_InferenceResponseParameterCount": (_ERR, [Ptr, POINTER(c_uint32)]),
    "TRITONSERVER_InferenceResponseParameter": (_ERR, [Ptr, c_uint32, POINTER(c_char_p), POINTER(c_int),
                                                       POINTER(c_void_p)]),
    "TRITONSERVER_InferenceResponseOutputCount": (_ERR, [Ptr, POINTER(c_uint32)]),
    "TRITONSERVER_InferenceResponseOutput": (_ERR, [Ptr, c_uint32, POINTER(c_char_p), POINTER(c_int),
                                                    POINTER(POINTER(c_int64)), POINTER(c_uint64),
                                                    POINTER(c_void_p), POINTER(c_size_t), POINTER(c_int),
                                                    POINTER(c_int64), POINTER(c_void_p)]),
}


@dataclass(frozen=True)
class LibraryLocation:
    library: Path
    dependency_dir: Path  # the folder with the library's renamed dependencies


def locate_library() -> LibraryLocation:
    """Where libtritonserver.so is, by the rules in the module's docstring."""
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise TritonLibraryError(f"{LIBRARY_ENV}={explicit}: no such file")
        return LibraryLocation(path, path.parent)
    if os.environ.get("LLM_SERVING_RUNTIME") == "triton":
        if not IMAGE_LIBRARY.is_file():
            raise TritonLibraryError(f"{IMAGE_LIBRARY} is missing: the image is not a Triton release image")
        return LibraryLocation(IMAGE_LIBRARY, IMAGE_LIBRARY.parent)
    from serving_image.triton.local_install import TritonNotInstalledError, locate

    try:
        local = locate()
    except TritonNotInstalledError as exc:
        raise TritonLibraryError(str(exc)) from exc
    return LibraryLocation(local.library, local.library_dir)


def on_loader_path(directory: Path, value: str | None = None) -> bool:
    value = os.environ.get("LD_LIBRARY_PATH", "") if value is None else value
    target = os.path.realpath(directory)
    return any(part and os.path.realpath(part) == target for part in value.split(os.pathsep))


def with_loader_path(directory: Path, value: str | None) -> str:
    return os.pathsep.join(p for p in (str(directory), value) if p)


_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_preloaded: list[ctypes.CDLL] = []  # dependencies loaded by path: kept referenced for the process's lifetime


def _load_with_dependencies(library: Path, dependency_dir: Path) -> ctypes.CDLL:
    """Load `library`; each dependency the loader cannot find is loaded first by its path in `dependency_dir` (its
    own missing dependencies likewise), after which the loader matches it by soname."""
    for _ in range(64):
        try:
            return ctypes.CDLL(str(library))
        except OSError as exc:
            missing = _MISSING.match(str(exc))
            if missing is None or missing.group(1) == str(library):
                raise TritonLibraryError(f"cannot load {library}: {exc}") from exc
            candidate = dependency_dir / missing.group(1)
            if not candidate.is_file():
                raise TritonLibraryError(
                    f"cannot load {library}: its dependency {missing.group(1)} is not in {dependency_dir}; the "
                    f"library needs its dependency folder on LD_LIBRARY_PATH before the process starts (run through "
                    f"`python -m serving_image.startup`, which arranges it, or set "
                    f"LD_LIBRARY_PATH={dependency_dir})") from exc
            _preloaded.append(_load_with_dependencies(candidate, dependency_dir))
    raise TritonLibraryError(f"cannot load {library}: too many missing dependencies")


def load_library(location: LibraryLocation | None = None) -> ctypes.CDLL:
    """The loaded library with every function this binding uses declared; loaded once per process."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        location = location or locate_library()
        if not location.dependency_dir.is_dir():
            raise TritonLibraryError(f"the dependency folder of {location.library} is missing: "
                                     f"{location.dependency_dir}")
        lib = _load_with_dependencies(location.library, location.dependency_dir)
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                function = getattr(lib, name)
            except AttributeError:
                raise TritonLibraryError(f"{location.library} has no {name}: not a Triton C API this binding "
                                         "supports") from None
            function.restype = restype
            function.argtypes = argtypes
        major, minor = c_uint32(), c_uint32()
        error = lib.TRITONSERVER_ApiVersion(ctypes.byref(major), ctypes.byref(minor))
        if error:
            lib.TRITONSERVER_ErrorDelete(error)
            raise TritonLibraryError("TRITONSERVER_ApiVersion failed")
        if major.value != API_MAJOR or minor.value < API_MINOR_MIN:
            raise TritonLibraryError(f"{location.library} implements Triton C API {major.value}.{minor.value}; this "
                                     f"binding needs {API_MAJOR}.{API_MINOR_MIN} or later within {API_MAJOR}.x")
        # Child processes Triton starts (the Python backend's stub) find the same dependencies.
        if not on_loader_path(location.dependency_dir):
            os.environ["LD_LIBRARY_PATH"] = with_loader_path(location.dependency_dir,
                                                             os.environ.get("LD_LIBRARY_PATH"))
        lib.api_version = (major.value, minor.value)
        lib.location = location
        _loaded = lib
        return lib
