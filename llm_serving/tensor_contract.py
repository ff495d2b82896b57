"""The KServe v2 tensor contract for LLMs (docs/architecture.md §3.3) and the I/O schema fingerprint (§3.4).

The contract is the one Triton's vLLM backend generates, so a client written against the local server works
unchanged against production Triton. The fingerprint is a hash of the canonical I/O description: it changes exactly
when a tensor is added, removed, renamed, retyped or reshaped, which is what decides red-black against versioned
rollouts (§4).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2 datatype name: BYTES, BOOL, UINT32, FP32, ...
    shape: tuple[int, ...]  # -1 = variable
    optional: bool = False


# NVIDIA's vLLM backend's auto_complete_config (triton-inference-server/vllm_backend src/model.py, the release
# compat.toml pins), in its order: what Triton reports for the model in production, and what the generated
# config.pbtxt writes out, so the local server (the stand-in backend) reports the same configuration.
VLLM_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "BYTES", (1,)),
    TensorSpec("image", "BYTES", (-1,), optional=True),
    TensorSpec("stream", "BOOL", (1,), optional=True),
    TensorSpec("sampling_parameters", "BYTES", (1,), optional=True),
    TensorSpec("exclude_input_in_output", "BOOL", (1,), optional=True),
    TensorSpec("return_finish_reason", "BOOL", (1,), optional=True),
    TensorSpec("return_cumulative_logprob", "BOOL", (1,), optional=True),
    TensorSpec("return_logprobs", "BOOL", (1,), optional=True),
    TensorSpec("return_num_input_tokens", "BOOL", (1,), optional=True),
    TensorSpec("return_num_output_tokens", "BOOL", (1,), optional=True),
    TensorSpec("embedding_request", "BYTES", (1,), optional=True),
)
VLLM_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("cumulative_logprob", "FP32", (-1,)),
    TensorSpec("logprobs", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)

# Triton's config.pbtxt data types and their KServe names.
_PBTXT_TO_KSERVE = {
    "TYPE_BOOL": "BOOL", "TYPE_UINT8": "UINT8", "TYPE_UINT16": "UINT16", "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64", "TYPE_INT8": "INT8", "TYPE_INT16": "INT16", "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64", "TYPE_FP16": "FP16", "TYPE_FP32": "FP32", "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES", "TYPE_BF16": "BF16",
}


def io_fingerprint(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> str:
    canonical = {
        "inputs": sorted((asdict(t) for t in inputs), key=lambda t: t["name"]),
        "outputs": sorted((asdict(t) for t in outputs), key=lambda t: t["name"]),
    }
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"sha256:{digest}"


VLLM_IO_FINGERPRINT = io_fingerprint(VLLM_INPUTS, VLLM_OUTPUTS)
# Fingerprints earlier versions of this contract had. Packages built then still carry them; a stack that names a
# new version of an LLM with one of these is restating an old contract by hand (tests/infra/test_io_fingerprints.py).
RETIRED_VLLM_IO_FINGERPRINTS = {
    # num_input_tokens dims [-1], none of the backend's optional inputs (image, return_*, embedding_request) nor its
    # cumulative_logprob/logprobs outputs
    "sha256:86d771a93cc9df8c392b98482497666c18236b57f5a267c8a4954e7ba144b651",
}


class PbtxtError(ValueError):
    pass


_BLOCK = re.compile(r"\b(input|output)\s*\[(.*?)\]\s*(?=\b(?:input|output|instance_group|parameters|backend|"
                    r"max_batch_size|dynamic_batching|model_transaction_policy|name|platform|"
                    r"ensemble_scheduling)\b|\Z)", re.S)
_ENTRY = re.compile(r"\{(.*?)\}", re.S)


def pbtxt_io(config_pbtxt: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Read the explicit I/O of a Python-backend `config.pbtxt` (only what the fingerprint needs)."""
    found: dict[str, list[TensorSpec]] = {"input": [], "output": []}
    for kind, body in _BLOCK.findall(config_pbtxt):
        for entry in _ENTRY.findall(body):
            name = re.search(r'name\s*:\s*"([^"]+)"', entry)
            dtype = re.search(r"data_type\s*:\s*(\w+)", entry)
            dims = re.search(r"dims\s*:\s*\[([^\]]*)\]", entry)
            if not (name and dtype and dims):
                raise PbtxtError(f"config.pbtxt: every {kind} needs name, data_type and dims; got {{{entry.strip()}}}")
            if dtype.group(1) not in _PBTXT_TO_KSERVE:
                raise PbtxtError(f"config.pbtxt: {kind} '{name.group(1)}' has unknown data_type {dtype.group(1)}")
            shape = tuple(int(d) for d in dims.group(1).replace(" ", "").split(",") if d)
            optional = bool(re.search(r"optional\s*:\s*true", entry))
            found[kind].append(TensorSpec(name.group(1), _PBTXT_TO_KSERVE[dtype.group(1)], shape, optional))
    if not found["input"] or not found["output"]:
        raise PbtxtError("config.pbtxt: a Python-backend model must declare its inputs and outputs explicitly")
    return tuple(found["input"]), tuple(found["output"])


def ensemble_step_names(config_pbtxt: str) -> tuple[str, ...]:
    """The model names an ensemble's `config.pbtxt` calls (its `ensemble_scheduling` steps), in order."""
    if not re.search(r"\bplatform\s*:\s*\"ensemble\"", config_pbtxt):
        raise PbtxtError('config.pbtxt: an ensemble package\'s config says platform: "ensemble"')
    names = tuple(re.findall(r'\bmodel_name\s*:\s*"([^"]+)"', config_pbtxt))
    if not names:
        raise PbtxtError("config.pbtxt: an ensemble needs ensemble_scheduling steps (model_name ...)")
    return names
