"""The Triton host, in the serving process (docs/architecture.md, "Where the code runs"): the C API binding (capi/),
Triton embedded in this process or run as a tritonserver child, the generated model repository, the local install,
the version pins and the image build's probe. The served model over it is serving_image/triton_adapter; what runs
in Triton's Python backend stub process is serving_image/triton_stub.
"""
