"""The C++ KServe gRPC front-end (native/triton/kserve_grpc.cpp) is compiled from native/triton/protos/kserve.binpb:
that file must be the KServe contract as the installed tritonclient ships it (the clients and the tests speak that
one), so a tritonclient upgrade that changes the protos fails here until the file is written again
(`python native/triton/protos/generate.py`)."""

from __future__ import annotations

import importlib.util

from google.protobuf import descriptor_pb2

from llm_serving.repository import REPO_ROOT

PROTOS = REPO_ROOT / "native" / "triton" / "protos"


def _generator():
    spec = importlib.util.spec_from_file_location("kserve_protos_generate", PROTOS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_protos_are_tritonclients():
    committed = descriptor_pb2.FileDescriptorSet.FromString((PROTOS / "kserve.binpb").read_bytes())
    installed = descriptor_pb2.FileDescriptorSet.FromString(_generator().descriptor_set())
    assert committed == installed, "native/triton/protos/kserve.binpb differs from the installed tritonclient's " \
                                   "protos: run native/triton/protos/generate.py"
    service = {f.name: f for f in committed.file}["grpc_service.proto"].service[0]
    methods = {m.name: m for m in service.method}
    assert methods["ModelStreamInfer"].client_streaming and methods["ModelStreamInfer"].server_streaming
    assert {"ModelInfer", "ServerLive", "ModelConfig", "RepositoryIndex"} <= set(methods)

