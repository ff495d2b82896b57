"""Write kserve.binpb: the KServe v2 gRPC service (grpc_service.proto) and the model configuration it imports
(model_config.proto) as a FileDescriptorSet, taken from NVIDIA's tritonclient (the generated modules it ships), so
that the C++ front-end (native/triton/kserve_grpc.cpp) is compiled from the very contract the Python clients and the
tests use. CMake gives it to protoc (`--descriptor_set_in`); the package's build never needs tritonclient.

    .venv-serving/bin/python native/triton/protos/generate.py

tests/native/test_kserve_grpc_protos.py checks that the file matches the installed tritonclient.
"""

from __future__ import annotations

import pathlib

OUT = pathlib.Path(__file__).with_name("kserve.binpb")


def descriptor_set() -> bytes:
    from google.protobuf import descriptor_pb2
    from tritonclient.grpc import model_config_pb2, service_pb2

    files = descriptor_pb2.FileDescriptorSet()
    for module in (model_config_pb2, service_pb2):  # dependencies first, as protoc reads them
        module.DESCRIPTOR.CopyToProto(files.file.add())
    return files.SerializeToString(deterministic=True)


if __name__ == "__main__":
    OUT.write_bytes(descriptor_set())
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
