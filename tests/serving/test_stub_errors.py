"""The engine's error messages (serving_image/triton_stub/stub_vllm.py `error_message`) as the Python-backend models
answer them: one mapping (engine_in_stub.error_answer) for the stand-in vllm backend's generation and embeddings and
for the scoring model, so an input error names its field whichever model answers. Fast: the models are loaded
with a stand-in for triton_python_backend_utils (tests/serving/conftest.py `stub_models`) and answer one message."""

from __future__ import annotations

import threading
import types

import pytest

from serving_image.triton_stub.backends.vllm.engine_in_stub import error_answer


@pytest.mark.parametrize(("message", "expected"), [
    ({"id": "r", "error": "must be an integer, got 'x'", "code": "INVALID_ARG", "field": "sampling_parameters.n"},
     ("sampling_parameters.n: must be an integer, got 'x'", "INVALID_ARG")),
    ({"id": "r", "error": "candidates[2]: too long", "code": "INVALID_ARG", "field": "candidates[2]"},
     ("candidates[2]: too long", "INVALID_ARG")),  # already leads with the field
    ({"id": "r", "error": "bad", "code": "INVALID_ARG", "field": None}, ("bad", "INVALID_ARG")),
    ({"id": "r", "error": "engine died", "code": "UNAVAILABLE"}, ("engine died", "UNAVAILABLE")),
    ({"id": "r", "error": "KeyError: 'x'", "code": "INTERNAL"}, ("KeyError: 'x'", "INTERNAL")),
    ({"id": "r", "error": "odd"}, ("odd", "INTERNAL")),
])
def test_error_answer(message, expected):
    assert error_answer(message) == expected


class _Sender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append((response.error.message, response.error.code, flags))


MESSAGE = {"id": "r1", "error": "must be a number, got 'x'", "code": "INVALID_ARG",
           "field": "sampling_parameters.temperature"}


def test_every_model_names_the_field(stub_models):
    generation, scoring = stub_models
    sender = _Sender()
    model = generation.TritonPythonModel.__new__(generation.TritonPythonModel)
    model._lock, model._requests = threading.Lock(), {"r1": types.SimpleNamespace(sender=sender)}
    model._answer(dict(MESSAGE))
    assert sender.sent == [(generation.ERROR_PREFIX + "sampling_parameters.temperature: must be a number, got 'x'",
                            "INVALID_ARG-code", 1)]
    assert model._requests == {}

    sender = _Sender()
    scoring.TritonPythonModel.__new__(scoring.TritonPythonModel)._answer(sender, dict(MESSAGE, code="UNAVAILABLE"))
    assert sender.sent == [("sampling_parameters.temperature: must be a number, got 'x'", "UNAVAILABLE-code", 1)]
    sender = _Sender()
    scoring.TritonPythonModel.__new__(scoring.TritonPythonModel)._answer(sender, dict(MESSAGE, code="WEIRD"))
    assert sender.sent[0][1] == "INTERNAL-code"
