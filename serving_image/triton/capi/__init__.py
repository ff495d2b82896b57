"""A ctypes binding of this project's own over Triton's C API (`tritonserver.h`, libtritonserver.so): what the
`openai` serving mode needs to run Triton inside its own process (docs/kserve.md "Embedded Triton").

One job per module:

    library.py     find and load libtritonserver.so (its dependency folder on the loader's path), declare every
                   function used with its C signature
    errors.py      TRITONSERVER_Error: codes, messages, `check()` turning an error pointer into TritonError
    server.py      server options (repository, backends, explicit model control, strict readiness, logging,
                   metrics), the server (live/ready/stop), models (load/ready/unload, metadata, config, index),
                   Prometheus metrics text
    inference.py   inference requests (BYTES and typed inputs, parameters, requested outputs), the response
                   allocator, decoupled response callbacks delivered into asyncio, cancellation

Nothing is imported from NVIDIA's `tritonserver` Python package (it does not exist here); the C signatures follow
`tritonserver.h` of the API version the library reports (1.34 for 2.51 locally).
"""

from serving_image.triton.capi.errors import ErrorCode, TritonError
from serving_image.triton.capi.inference import InferenceStream, Response
from serving_image.triton.capi.library import TritonLibraryError, load_library
from serving_image.triton.capi.server import ModelControlMode, Server, ServerOptions

__all__ = ["ErrorCode", "InferenceStream", "ModelControlMode", "Response", "Server", "ServerOptions",
           "TritonError", "TritonLibraryError", "load_library"]
