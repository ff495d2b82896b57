"""ticket-triage: a Python-backend model around an LLM (the reason the platform keeps the Python backend).

For each ticket: apply this model's own prompt template, after cutting the ticket to a token budget counted with
its own tokenizer (triage_text.py); call the LLM model of the same Triton server through business-logic scripting
(BLS), streamed, with its output constrained to the record's JSON schema; parse the text into a typed record
(triage_record.py) and return its fields as typed tensors. With `stream` true the LLM's text is forwarded as it
arrives (`text_output` responses), then the record; otherwise one response holds both.

Config parameters: `llm_model` (the model to call) and `ticket_token_budget`.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from triage_record import SCHEMA, RecordError, Triage
from triage_text import fit_to_budget, render_prompt

MAX_TOKENS = 200


def _bytes_tensor(name: str, value: str) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.llm_model = parameters["llm_model"]
        self.budget = int(parameters["ticket_token_budget"])
        self.sampling = json.dumps({"max_tokens": MAX_TOKENS, "temperature": 1.0,
                                    "structured_outputs": json.dumps({"json": SCHEMA})})

    def _llm_request(self, prompt: str) -> pb_utils.InferenceRequest:
        inputs = [
            _bytes_tensor("text_input", prompt),
            pb_utils.Tensor("stream", np.array([True])),
            pb_utils.Tensor("exclude_input_in_output", np.array([True])),
            _bytes_tensor("sampling_parameters", self.sampling),
            pb_utils.Tensor("return_finish_reason", np.array([True])),
        ]
        return pb_utils.InferenceRequest(model_name=self.llm_model, inputs=inputs,
                                         requested_output_names=["text_output", "finish_reason"])

    def _triage(self, request, sender) -> None:
        raw = pb_utils.get_input_tensor_by_name(request, "ticket").as_numpy().reshape(-1)[0]
        ticket = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        flag = pb_utils.get_input_tensor_by_name(request, "stream")
        stream = bool(flag.as_numpy().reshape(-1)[0]) if flag is not None else False
        if not ticket.strip():
            raise ValueError("input 'ticket' is empty")
        fitted = fit_to_budget(ticket, self.budget)
        text, finish = "", None
        for response in self._llm_request(render_prompt(fitted.text)).exec(decoupled=True):
            if response.has_error():
                raise RuntimeError(f"{self.llm_model}: {response.error().message()}")
            chunk = pb_utils.get_output_tensor_by_name(response, "text_output")
            if chunk is None:
                continue  # the empty final response
            piece = "".join(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in chunk.as_numpy())
            reason = pb_utils.get_output_tensor_by_name(response, "finish_reason")
            if reason is not None:
                finish = reason.as_numpy().reshape(-1)[0].decode()
            text += piece
            if stream and piece:
                sender.send(pb_utils.InferenceResponse([_bytes_tensor("text_output", piece)]))
        if finish != "stop":
            raise RecordError(f"{self.llm_model} stopped with finish reason {finish!r} before the record was complete")
        record = Triage.parse(text)
        outputs = [
            _bytes_tensor("category", record.category),
            pb_utils.Tensor("priority", np.array([record.priority], dtype=np.int32)),
            _bytes_tensor("summary", record.summary),
            pb_utils.Tensor("ticket_tokens", np.array([fitted.tokens], dtype=np.int32)),
            pb_utils.Tensor("truncated", np.array([fitted.truncated])),
        ]
        if not stream:
            outputs.insert(0, _bytes_tensor("text_output", text))
        sender.send(pb_utils.InferenceResponse(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._triage(request, sender)
            except ValueError as exc:  # RecordError included: the request's or the LLM's answer cannot be used
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    message=str(exc), code=pb_utils.TritonError.INVALID_ARG)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # the LLM failed: a server-side error, never the caller's
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    message=str(exc), code=pb_utils.TritonError.UNAVAILABLE)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
