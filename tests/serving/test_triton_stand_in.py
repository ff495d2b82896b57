"""The stand-in `vllm` backend's pure parts, without Triton: its declared I/O is the tensor contract, and
`sampling_parameters` is read as NVIDIA's backend reads it (with every refusal naming the field)."""

from __future__ import annotations

import ast
import json
import os

import pytest

from llm_serving.repository import REPO_ROOT
from llm_serving.tensor_contract import VLLM_INPUTS, VLLM_OUTPUTS
from serving_image.served_model import ModelInfo
from serving_image.triton_stub.stub_vllm import ParameterError, sampling_params_from_json

MODEL_PY = REPO_ROOT / "serving_image" / "triton_stub" / "backends" / "vllm" / "model.py"
INFO = ModelInfo(name="m", version="1", max_model_len=512, vocab_size=1000, eos_token_id=2)
_TYPES = {"TYPE_STRING": "BYTES", "TYPE_BOOL": "BOOL", "TYPE_UINT32": "UINT32", "TYPE_FP32": "FP32"}


def _declared(name: str) -> list[dict]:
    """INPUTS / OUTPUTS of model.py, read without importing it (it needs Triton's stub)."""
    for node in ast.parse(MODEL_PY.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {MODEL_PY}")


def test_auto_complete_declares_the_tensor_contract():
    for declared, contract in ((_declared("INPUTS"), VLLM_INPUTS), (_declared("OUTPUTS"), VLLM_OUTPUTS)):
        assert [(d["name"], _TYPES[d["data_type"]], tuple(d["dims"]), d.get("optional", False)) for d in declared] \
            == [(t.name, t.datatype, t.shape, t.optional) for t in contract]


def _params(value, root="sampling_parameters"):
    return sampling_params_from_json(value if isinstance(value, str) else json.dumps(value), root, INFO)


def test_fields_are_converted_as_the_backend_does():
    params = _params({"max_tokens": "64", "temperature": "0.5", "top_k": 5.0, "ignore_eos": True, "seed": None,
                      "stop": ["\n"], "skip_special_tokens": False})
    assert (params.max_tokens, params.temperature, params.top_k, params.ignore_eos) == (64, 0.5, 5, True)
    assert params.seed is None and params.stop == ["\n"] and params.skip_special_tokens is False
    assert _params({}).max_tokens == 16  # vLLM's default, which the backend keeps


def test_the_params_are_made_for_one_request_and_not_copied_again_at_admission():
    # skip_clone, as vLLM's own server makes them: AsyncLLM deep-copies params without it, 130 µs a request on the
    # engine's thread. A request may not set it (the backend owns it).
    assert _params({"max_tokens": 3}).skip_clone is True
    with pytest.raises(ParameterError, match="skip_clone is not a vLLM SamplingParams field"):
        _params({"skip_clone": False})


def test_structured_outputs_string_and_guided_decoding_string_or_object():
    schema = {"type": "object"}
    assert _params({"structured_outputs": json.dumps({"json": schema})}).structured_outputs.json == schema
    assert _params({"guided_decoding": {"json": schema, "backend": "xgrammar"}}).structured_outputs.json == schema
    assert _params({"guided_decoding": json.dumps({"regex": "a+"})}).structured_outputs.regex == "a+"


def test_extra_args_pass_through_and_the_constraint_is_validated():
    params = _params({"extra_args": {"constraint": {"kind": "allowed_tokens", "tokens": [5, 7]}, "trace": "x"}})
    # The constraint goes on as its JSON text, the form vLLM carries cheaply (docs/architecture.md §3.5).
    assert params.extra_args["trace"] == "x"
    assert json.loads(params.extra_args["constraint"]) == {"kind": "allowed_tokens", "tokens": [5, 7]}


@pytest.mark.parametrize(("value", "field"), [
    ("{not json", "sampling_parameters"),
    ("[1]", "sampling_parameters"),
    ({"max_token": 3}, "sampling_parameters.max_token"),
    ({"temperature": "hot"}, "sampling_parameters.temperature"),
    ({"temperature": -1}, "sampling_parameters.temperature"),
    ({"ignore_eos": "false"}, "sampling_parameters.ignore_eos"),
    ({"max_tokens": 1.5}, "sampling_parameters.max_tokens"),
    ({"output_kind": 1}, "sampling_parameters.output_kind"),
    ({"structured_outputs": {"json": {}}}, "sampling_parameters.structured_outputs"),
    ({"structured_outputs": json.dumps({"jsn": {}})}, "sampling_parameters.structured_outputs.jsn"),
    ({"guided_decoding": {"regex": "a", "backend": "outlines"}}, "sampling_parameters.guided_decoding.backend"),
    ({"constraint": {"kind": "allowed_tokens", "tokens": [5]}}, "sampling_parameters.constraint"),
    ({"extra_args": {"constraint": {"kind": "allowed_tokens", "tokens": [5000]}}},
     "sampling_parameters.extra_args.constraint.tokens[0]"),
    ({"extra_args": {"constraint": {"kind": "allowed_tokens", "tokens": [5]}},
      "structured_outputs": json.dumps({"regex": "a"})}, "sampling_parameters.extra_args.constraint"),
    ({"lora_name": "x"}, "sampling_parameters.lora_name"),
])
def test_refusals_name_the_field(value, field):
    with pytest.raises(ParameterError) as info:
        _params(value)
    assert info.value.field == field and field in str(info.value)


def test_request_parameters_drop_what_triton_consumes():
    params = sampling_params_from_json(json.dumps({"max_tokens": 3, "triton_enable_empty_final_response": True}),
                                       "parameters", INFO)
    assert params.max_tokens == 3
    with pytest.raises(ParameterError, match="parameters.max_token "):
        sampling_params_from_json(json.dumps({"max_token": 3}), "parameters", INFO)


# -- the local Triton installation ----------------------------------------------------------------------------


def test_makefile_installs_the_pinned_triton():
    import re

    from serving_image.triton.pins import load_pins

    makefile = (REPO_ROOT / "Makefile").read_text()
    pin = load_pins().local_triton
    assert re.search(rf"^TRITON_WHEEL := {re.escape(pin.distribution)}=={re.escape(pin.distribution_version)}$",
                     makefile, re.M)
    assert re.search(rf"^STUB_NUMPY := numpy=={re.escape(pin.stub_numpy)}$", makefile, re.M)
    assert re.search(rf"^STUB_XGBOOST := xgboost=={re.escape(pin.stub_xgboost)}$", makefile, re.M)
    assert re.search(rf"^STUB_SCIPY := scipy=={re.escape(pin.stub_scipy)}$", makefile, re.M)
    assert f"python_backend_stubs/{pin.python_backend_stub}/" in makefile


def test_local_install_finds_everything_and_composes_the_backend_directory(tmp_path):
    from serving_image.triton.local_install import locate

    local = locate()
    assert local.binary.is_file() and local.library.name.startswith("libtritonserver")
    backends = local.backend_directory(tmp_path / "backends")
    assert (backends / "python" / "triton_python_backend_stub").exists()
    assert (backends / "python" / "numpy").is_dir()  # the stub's numpy (< 2), on the stub's sys.path
    assert (backends / "vllm" / "model.py").resolve() == MODEL_PY
    assert local.backend_directory(tmp_path / "backends") == backends  # idempotent


def test_a_missing_triton_says_how_to_get_it(tmp_path):
    from serving_image.triton.local_install import TritonNotInstalledError, locate

    with pytest.raises(TritonNotInstalledError, match="make triton-env"):
        locate(tmp_path / "nowhere")
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    with pytest.raises(TritonNotInstalledError, match="nvidia-pytriton is not installed .*make triton-env"):
        locate(tmp_path / "venv")


def test_the_engine_thread_takes_the_niceness_it_is_given_and_its_processes_inherit_it():
    """$LLM_SERVING_ENGINE_NICE (the rehearsal sets it): the engine's thread in the stub lowers its own priority
    before vLLM's processes start, and they inherit it, while the stub's other threads (the one answering Triton's
    health checks) keep theirs; anything but 1..19 stops it, naming the variable."""
    import subprocess
    import sys

    code = ("import os, subprocess, sys, threading\n"
            "from serving_image.triton_stub.backends.vllm.engine_in_stub import lower_priority\n"
            "out = {}\n"
            "def engine():\n"
            "    lower_priority(sys.argv[1] or None)\n"
            "    out['child'] = subprocess.run([sys.executable, '-c', 'import os; print(os.nice(0))'],\n"
            "                                  capture_output=True, text=True, check=True).stdout.strip()\n"
            "t = threading.Thread(target=engine); t.start(); t.join()\n"
            "print(out.get('child'), os.nice(0))\n")

    def run(value: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, value], capture_output=True, text=True, timeout=120)

    assert run("10").stdout.split() == ["10", "0"]
    assert run("").stdout.split() == ["0", "0"]
    for bad in ("0", "20", "-5", "high"):
        done = run(bad)
        assert "$LLM_SERVING_ENGINE_NICE" in done.stderr and "1 to 19" in done.stderr, bad


def test_the_stub_log_level_is_read_from_its_variable_and_a_bad_one_is_named():
    """$LLM_SERVING_STUB_LOG_LEVEL sets the level of the project's loggers in the stub (INFO when unset: a request's
    way into the engine, logged at DEBUG, is then not written); anything but DEBUG/INFO/WARNING/ERROR is refused,
    naming the variable."""
    import logging

    from serving_image.triton_stub.backends.vllm.engine_in_stub import StubEnvironmentError, stub_log_level

    assert stub_log_level(None) == stub_log_level("") == stub_log_level("INFO") == logging.INFO
    assert stub_log_level("DEBUG") == logging.DEBUG and stub_log_level("ERROR") == logging.ERROR
    for bad in ("debug", "TRACE", "10"):
        with pytest.raises(StubEnvironmentError, match=rf"\$LLM_SERVING_STUB_LOG_LEVEL='{bad}': one of DEBUG, INFO"):
            stub_log_level(bad)


def test_a_bad_niceness_stops_the_engine_before_vllm_starts():
    """With a bad $LLM_SERVING_ENGINE_NICE the in-stub engine reports itself failed, naming the variable, and starts
    no vLLM: the stand-in's initialize raises that failure as "[vllm] Failed to start engine: ...", so the model
    does not load and the startup procedure's step 4 fails (a process of its own: the stub's environment is set up
    once per process)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from serving_image.triton_stub.backends.vllm import engine_in_stub as stub\n"
            "engine = stub.InStubEngine(sys.executable, '{}', 'demo-tiny', '1')\n"
            "print(engine.first['op'], '|', engine.start_failure(), '|', 'vllm' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LLM_SERVING_ENGINE_NICE": "20"})
    assert done.returncode == 0, done.stderr
    op, failure, vllm_imported = done.stdout.strip().split(" | ")
    assert op == "failed" and "$LLM_SERVING_ENGINE_NICE='20'" in failure and "1 to 19" in failure
    assert vllm_imported == "False"  # stopped before the engine's loop imports vLLM
