"""The client of every model (docs/clients.md): one method per kind of call, whatever serves the model.

    client = Client.from_file("/etc/llm-serving/stack-outputs.json", api_key=...)
    scores = client.infer("ranker", {"features": rows}, version="4.0.0")["score"]
    answer = client.chat("chat-large", [{"role": "user", "content": "hi"}], response_format={"type": "json_object"})
    for delta in client.chat(experiment="chat-temperature", unit=user_id, messages=msgs, stream=True): ...

Every call: a deadline (each attempt gets what is left), retries only where safe, an OpenTelemetry span with a span
per stage, the W3C trace context and the experiment's arm sent to the server, one JSON record per call, per-arm
counts, errors and latencies. Errors name the model, the version and the field.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openai
from opentelemetry import trace

from llm_serving import pod_contract as pc
from llm_serving.batch_cache import ResultCache
from llm_serving.caller_key import key_from_env
from llm_serving.object_store import open_object_store
from llm_serving.stack_outputs import StackOutputs, StackOutputsError
from llm_serving_client.deadline import Deadline
from llm_serving_client.discovery import Discovery, LocalEndpoints, Route, load_outputs
from llm_serving_client.errors import CallError, ExperimentError, InvalidRequest
from llm_serving_client.experiments import HEADER, ArmStats, Assignment, Experiments
from llm_serving_client.gateway import GatewayEndpoints
from llm_serving_client.inprocess.fetch import FetchError, fetch_package
from llm_serving_client.inprocess.python_model import InProcessError, InProcessModel
from llm_serving_client.observe import Call, Observer
from llm_serving_client.openai_calls import OpenAITransport, translate_error
from llm_serving_client.retry import RetryPolicy, call_with_retries
from llm_serving_client.tensor import ModelIO, TensorTransport, check_inputs

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    trace_id: str
    arm: str | None = None
    cached: bool = False  # answered from the batch path's result cache, no model call


@dataclass
class ChatStream:
    """The deltas of a streamed generation, in order; `finish_reason` and `text` are complete once iterated."""

    _deltas: Iterator[str]
    trace_id: str = ""
    arm: str | None = None
    finish_reason: str | None = None
    text: str = ""
    _parts: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[str]:
        return self._deltas


@dataclass(frozen=True)
class _Resolved:
    model: str
    version: str | None
    parameters: dict[str, Any]
    assignment: Assignment | None
    assignment_ns: tuple[int, int] | None  # when the assignment ran (its span is recorded inside the call's)


ENV_API_KEY = "LLM_SERVING_API_KEY"  # the caller's key
ENV_API_KEY_FILE = "LLM_SERVING_API_KEY_FILE"  # a file holding it (a mounted Secret); wins over ENV_API_KEY


def api_key_from_env(environ=None) -> str | None:
    """The caller's key from ENV_API_KEY_FILE (named but missing or empty: an error naming it, never a keyless
    call) or ENV_API_KEY; None when neither is set."""
    return key_from_env(ENV_API_KEY_FILE, ENV_API_KEY, "the API key", environ)


class Client:
    def __init__(self, outputs: StackOutputs, *, api_key: str | None = None, local: LocalEndpoints | None = None,
                 gateway: GatewayEndpoints | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, tracer_provider: trace.TracerProvider | None = None,
                 log_sample_rate: float = 1.0, result_cache: ResultCache | None = None):
        """`local`: every route at one local server (no stack); `gateway`: the stack's routes as they are named,
        each connection to the gateway at this address (llm_serving_client.gateway)."""
        self.discovery = Discovery(outputs, local, gateway)
        self.experiments = Experiments(outputs.experiments)
        self.timeout_s, self.retry = timeout_s, retry or RetryPolicy()
        self._observer = Observer(tracer_provider, log_sample_rate)
        self._tensor = TensorTransport()
        # The caller's credential (docs/clients.md, "Credentials"): sent as `Authorization: Bearer <key>` on OpenAI
        # and KServe HTTP and as the `authorization` metadata on KServe gRPC; the gateway and the pod both check it.
        api_key = api_key if api_key is not None else api_key_from_env()
        self._auth = {pc.AUTHORIZATION_HEADER: pc.bearer_value(api_key)} if api_key else {}
        self._openai = OpenAITransport(api_key)
        self._in_process: dict[tuple[str, str], InProcessModel] = {}
        # The batch path's content-addressed answers (llm_serving.batch_cache), read first by `chat(cached=True)`.
        self._cache = result_cache

    @classmethod
    def from_file(cls, path=None, *, read_cache: bool = False, **kwargs) -> Client:
        """From the stack-outputs file the service's deployment renders (default: $LLM_SERVING_STACK_OUTPUTS).
        `read_cache`: read cached batch answers from the stack's `batch.cache` (S3, this process's credentials)."""
        outputs = load_outputs(path)
        if read_cache:
            if outputs.batch is None:
                raise StackOutputsError(f"stack {outputs.stack} renders no batch block: there is no result cache "
                                        f"to read")
            import boto3

            cache = outputs.batch.cache
            store = open_object_store(f"s3://{cache.bucket}/{cache.prefix}".rstrip("/"),
                                      client=boto3.client("s3", region_name=cache.region))
            kwargs["result_cache"] = ResultCache(store)
        return cls(outputs, **kwargs)

    def close(self) -> None:
        self._tensor.close()
        self._openai.close()
        for local in self._in_process.values():
            local.close()
        self._in_process.clear()

    def experiment_stats(self, name: str) -> dict[str, ArmStats]:
        return self.experiments.stats(name)

    # -- in-process models -------------------------------------------------------------------------------------

    def load_in_process(self, model: str, version: str, source: Path | str | None = None,
                        workdir: Path | None = None, *, cache_dir: Path | None = None, s3=None) -> None:
        """Run `model` `version` in this process from its published package, verified against what the stack
        outputs name; every later `infer` of that version runs here. Only a model the stack marks `inProcess`.
        `source`: a local copy (package directory or archive); without it the package is fetched from the outputs'
        `inProcess.versions[<version>].package` into `cache_dir/<model>/<version>` (default: a temporary
        directory) with `s3` (a boto3 S3 client; default: boto3's)."""
        outputs = self.discovery.model(model)
        marked = outputs.in_process
        if marked is None:
            raise InProcessError(f"model {model!r}: the stack does not mark it inProcess; it is called remotely")
        if version not in marked.versions:
            raise InProcessError(f"model {model!r} version {version!r}: the stack marks only "
                                 f"{sorted(marked.versions)} for in-process execution")
        key = (model, version)
        if key in self._in_process:
            raise InProcessError(f"model {model!r} version {version!r} is already loaded in this process")
        if source is None:
            root = Path(cache_dir) if cache_dir is not None else Path(tempfile.mkdtemp(prefix="llm-serving-client-"))
            try:
                source = fetch_package(marked.versions[version].package, root / model / version, s3)
            except FetchError as exc:
                raise InProcessError(f"model {model!r} version {version!r}: {exc}") from None
        self._in_process[key] = InProcessModel(Path(source), model_id=model, version=version,
                                               io_fingerprint=marked.versions[version].io_fingerprint,
                                               workdir=workdir)

    def in_process_io(self, model: str, version: str) -> ModelIO:
        """The inputs and outputs of a model loaded in this process (its config.pbtxt's)."""
        try:
            return self._in_process[(model, version)].io
        except KeyError:
            raise InProcessError(f"model {model!r} version {version!r} is not loaded in this process") from None

    def _local(self, model: str, version: str | None) -> InProcessModel | None:
        if not self._in_process:
            return None
        served = self.discovery.model(model)
        return self._in_process.get((model, version or served.active_version))

    # -- experiments -------------------------------------------------------------------------------------------

    def _resolve(self, model: str | None, version: str | None, experiment: str | None, unit: str | None,
                 parameters: Mapping[str, Any]) -> _Resolved:
        if experiment is None:
            if model is None:
                raise ValueError("name the model, or an experiment whose arm names it")
            return _Resolved(model, version, dict(parameters), None, None)
        where = model or "?"
        if not unit:
            raise ExperimentError(f"experiment {experiment!r} needs the call's unit id (its "
                                  f"{self.discovery.outputs.experiment(experiment).unit})", model=where)
        start = time.time_ns()
        assignment = self.experiments.assign(experiment, unit, self.discovery.outputs.stack, expose=False)
        span_ns = (start, time.time_ns())
        arm = assignment.arm
        if model is not None and model != arm.model:
            raise ExperimentError(f"experiment {experiment!r} arm {arm.name!r} calls {arm.model!r}, not this call's "
                                  f"model", model=model)
        if version is not None:
            raise ExperimentError(f"experiment {experiment!r} chooses the version (arm {arm.name!r}: "
                                  f"{arm.version or 'the route'}); do not pin one too", model=arm.model,
                                  version=version)
        clash = sorted(set(parameters) & set(arm.parameters))
        if clash:
            raise ExperimentError(f"experiment {experiment!r} arm {arm.name!r} sets it; the call sets it too",
                                  model=arm.model, field=clash[0])
        self.experiments.expose(assignment)  # the call goes ahead: the unit is exposed
        return _Resolved(arm.model, arm.version, {**parameters, **arm.parameters}, assignment, span_ns)

    def _open(self, call_kind: str, resolved: _Resolved):
        a = resolved.assignment
        return self._observer.call(call_kind, resolved.model, resolved.version, a and a.experiment,
                                   a and a.arm.name)

    def _begin(self, call: Call, resolved: _Resolved) -> dict[str, str]:
        """Record the assignment's stage in the call and return the headers every attempt adds (the arm)."""
        if resolved.assignment_ns is not None:
            start, end = resolved.assignment_ns
            span = self._observer.tracer.start_span("assignment", context=trace.set_span_in_context(call._span),
                                                    start_time=start, attributes={"llm_serving.stage": "assignment"})
            span.end(end_time=end)
            call.add_stage("assignment", (end - start) / 1e9)
        return {**self._auth, **({HEADER: resolved.assignment.header} if resolved.assignment else {})}

    def _finish(self, resolved: _Resolved, started: float, error: bool) -> None:
        if resolved.assignment is not None:
            self.experiments.record(resolved.assignment, time.perf_counter() - started, error)

    # -- tensor inference --------------------------------------------------------------------------------------

    def infer(self, model: str | None = None, inputs: Mapping[str, np.ndarray] | None = None, *,
              outputs: Sequence[str] | None = None, version: str | None = None, experiment: str | None = None,
              unit: str | None = None, deadline_s: float | None = None) -> dict[str, np.ndarray]:
        """KServe v2 ModelInfer: `inputs` by name (numpy arrays, the model's datatypes and shapes), the named
        `outputs` (default: every output) back as numpy arrays."""
        deadline = Deadline.after(deadline_s or self.timeout_s)
        resolved = self._resolve(model, version, experiment, unit, {})
        route = self.discovery.route(resolved.model, "grpc", resolved.version)
        if route.kind == "vllm":
            raise InvalidRequest("is an LLM (a decoupled model, no unary ModelInfer); call chat()",
                                 model=route.model, version=route.version)
        if resolved.assignment and resolved.assignment.arm.parameters:
            raise ExperimentError("an arm's parameters are request fields; tensor inference takes none",
                                  model=route.model, field=sorted(resolved.assignment.arm.parameters)[0])
        local = self._local(resolved.model, resolved.version)
        if local is not None:
            return self._infer_here(local, route, resolved, inputs or {}, outputs)
        started, error = time.perf_counter(), True
        try:
            with self._open("infer", resolved) as call:
                extra = self._begin(call, resolved)
                with call.stage("preprocess"):
                    io = self._tensor.model_io(route, deadline.timeout(route.model, route.version),
                                               call.headers(extra))
                    check_inputs(route, io, inputs or {})
                    wanted = list(outputs) if outputs is not None else sorted(io.outputs)
                    unknown = [o for o in wanted if o not in io.outputs]
                    if unknown:
                        raise InvalidRequest(f"is not an output of the model (outputs: {sorted(io.outputs)})",
                                             model=route.model, version=route.version, field=unknown[0])
                with call.stage("serialise"):
                    wire = self._tensor.serialise(inputs or {}, io)
                with call.stage("network"):
                    result = self._attempts(call, deadline, route, safe=True, attempt=lambda: self._tensor.infer(
                        route, wire, wanted, deadline.timeout(route.model, route.version), call.headers(extra)))
                with call.stage("postprocess"):
                    answer = {name: result.as_numpy(name) for name in wanted}
            error = False
            return answer
        finally:
            self._finish(resolved, started, error)

    def _infer_here(self, local: InProcessModel, route: Route, resolved: _Resolved, inputs: Mapping[str, np.ndarray],
                    outputs: Sequence[str] | None) -> dict[str, np.ndarray]:
        """The same call on the model loaded in this process: the same input checks (against its config.pbtxt, as
        Triton would), its `execute` as the inference stage; no serialisation, no network."""
        started, error = time.perf_counter(), True
        route = Route(local.model_id, route.kind, local.version, "in-process", tls=False)
        try:
            with self._open("infer", resolved) as call:
                self._begin(call, resolved)
                with call.stage("preprocess"):
                    check_inputs(route, local.io, inputs)
                    wanted = list(outputs) if outputs is not None else sorted(local.io.outputs)
                    unknown = [o for o in wanted if o not in local.io.outputs]
                    if unknown:
                        raise InvalidRequest(f"is not an output of the model (outputs: {sorted(local.io.outputs)})",
                                             model=route.model, version=route.version, field=unknown[0])
                with call.stage("inference"):
                    answer = local.execute(inputs, wanted)
            error = False
            return answer
        finally:
            self._finish(resolved, started, error)

    def _attempts(self, call: Call, deadline: Deadline, route: Route, *, safe: bool, attempt):
        def one(n: int):
            call.record.attempts = n
            return attempt()
        return call_with_retries(one, policy=self.retry, deadline=deadline, safe=safe)

    # -- generation --------------------------------------------------------------------------------------------

    def chat(self, model: str | None = None, messages: Sequence[Mapping[str, Any]] = (), *, stream: bool = False,
             response_format: Mapping[str, Any] | None = None, constraint: Mapping[str, Any] | None = None,
             experiment: str | None = None, unit: str | None = None, deadline_s: float | None = None,
             cached: bool = False, **parameters: Any) -> ChatResult | ChatStream:
        """/v1/chat/completions. `parameters` are the request's other fields (max_tokens, temperature, ...);
        `constraint` is the platform's extension (docs/architecture.md §3.5), sent in the body beside them.
        `cached`: answer from the batch path's result cache when it holds this request's answer (only deterministic
        requests are cached: greedy or seeded), else call the model."""
        deadline = Deadline.after(deadline_s or self.timeout_s)
        resolved = self._resolve(model, None, experiment, unit, parameters)
        route = self.discovery.route(resolved.model, "openai", resolved.version)
        body: dict[str, Any] = {"model": route.model, "messages": list(messages), **resolved.parameters}
        if response_format is not None:
            body["response_format"] = dict(response_format)
        extra_body = {"constraint": dict(constraint)} if constraint is not None else {}
        if stream:
            if cached:
                raise ValueError("cached answers are whole answers: pass stream=False with cached=True")
            return self._chat_stream(route, resolved, body, extra_body, deadline)
        if cached and self._cache is None:
            raise ValueError("cached=True needs a result cache (Client(result_cache=...), from_file(read_cache=True))")
        started, error = time.perf_counter(), True
        try:
            with self._open("chat", resolved) as call:
                extra = self._begin(call, resolved)
                if cached:
                    hit = self._cached(call, route, resolved, {**body, **extra_body})
                    if hit is not None:
                        error = False
                        return hit
                with call.stage("network"):
                    # Not streamed: nothing reaches the caller before the whole answer, so UNAVAILABLE is safe to
                    # retry (no output was delivered).
                    answer = self._attempts(call, deadline, route, safe=True, attempt=lambda: self._openai.chat(
                        route, body, extra_body, deadline.timeout(route.model, route.version), call.headers(extra)))
                with call.stage("postprocess"):
                    choice = answer.choices[0]
                    result = ChatResult(choice.message.content or "", choice.finish_reason,
                                        answer.usage.prompt_tokens if answer.usage else 0,
                                        answer.usage.completion_tokens if answer.usage else 0,
                                        call.record.trace_id or "",
                                        resolved.assignment.arm.name if resolved.assignment else None)
            error = False
            return result
        finally:
            self._finish(resolved, started, error)

    def _cached(self, call: Call, route: Route, resolved: _Resolved, body: dict[str, Any]) -> ChatResult | None:
        """The cached answer of this exact request for the version the route serves (a red-black model: its active
        version; answers of a candidate mid-rollout are not read), or None on a miss (recorded on the span)."""
        version = resolved.version or self.discovery.model(route.model).active_version
        with call.stage("cache"):
            lookup = self._cache.get(route.model, version, "/v1/chat/completions", body)
        call.record.cache = "hit" if lookup.hit else f"miss ({lookup.why_miss})"
        if not lookup.hit:
            return None
        choice, usage = lookup.response["choices"][0], lookup.response.get("usage") or {}
        return ChatResult(choice["message"].get("content") or "", choice.get("finish_reason"),
                          usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                          call.record.trace_id or "",
                          resolved.assignment.arm.name if resolved.assignment else None, cached=True)

    def _chat_stream(self, route: Route, resolved: _Resolved, body: dict[str, Any], extra_body: dict[str, Any],
                     deadline: Deadline) -> ChatStream:
        body = {**body, "stream": True}
        holder = ChatStream(iter(()), arm=resolved.assignment.arm.name if resolved.assignment else None)

        def deltas() -> Iterator[str]:
            started, error = time.perf_counter(), True
            try:
                with self._open("chat", resolved) as call:
                    holder.trace_id = call.record.trace_id or ""
                    extra = self._begin(call, resolved)

                    def first_chunk():
                        # Retried only up to here: once a chunk reached the caller the stream is never repeated.
                        stream = self._openai.chat(route, body, extra_body,
                                                   deadline.timeout(route.model, route.version), call.headers(extra))
                        chunks = iter(stream)
                        try:
                            return stream, chunks, next(chunks, None)
                        except openai.OpenAIError as exc:  # the server failed before its first chunk
                            stream.close()
                            raise translate_error(route, exc) from None

                    with call.stage("network"):
                        stream, chunks, chunk = self._attempts(call, deadline, route, safe=True, attempt=first_chunk)
                    began = time.perf_counter()
                    try:
                        while chunk is not None:
                            if chunk.choices:
                                choice = chunk.choices[0]
                                holder.finish_reason = choice.finish_reason or holder.finish_reason
                                if choice.delta and choice.delta.content:
                                    holder._parts.append(choice.delta.content)
                                    yield choice.delta.content
                            chunk = next(chunks, None)
                    except openai.OpenAIError as exc:
                        raise translate_error(route, exc) from None
                    finally:
                        stream.close()
                        call.add_stage("inference", time.perf_counter() - began)
                        holder.text = "".join(holder._parts)
                error = False
            finally:
                self._finish(resolved, started, error)

        holder._deltas = deltas()
        return holder

    # -- embeddings and scores ---------------------------------------------------------------------------------

    def embed(self, model: str, inputs: Sequence[str], *, deadline_s: float | None = None,
              **parameters: Any) -> list[list[float]]:
        """/v1/embeddings: one vector per input, in order."""
        deadline = Deadline.after(deadline_s or self.timeout_s)
        resolved = self._resolve(model, None, None, None, parameters)
        route = self.discovery.route(model, "openai")
        body = {"model": route.model, "input": list(inputs), **resolved.parameters}
        with self._open("embed", resolved) as call:
            with call.stage("network"):
                answer = self._attempts(call, deadline, route, safe=True, attempt=lambda: self._openai.embeddings(
                    route, body, deadline.timeout(route.model, None), call.headers()))
            with call.stage("postprocess"):
                return [list(d.embedding) for d in sorted(answer.data, key=lambda d: d.index)]

    def score(self, model: str, prompt: str, candidates: Sequence[str], *,
              deadline_s: float | None = None) -> list[float]:
        """/v1/score: the log-probability of each candidate continuation of `prompt`, in order."""
        deadline = Deadline.after(deadline_s or self.timeout_s)
        resolved = self._resolve(model, None, None, None, {})
        route = self.discovery.route(model, "openai")
        body = {"model": route.model, "prompt": prompt, "candidates": list(candidates)}
        with self._open("score", resolved) as call:
            with call.stage("network"):
                answer = self._attempts(call, deadline, route, safe=True, attempt=lambda: self._openai.score(
                    route, body, deadline.timeout(route.model, None), call.headers()))
            with call.stage("postprocess"):
                return [d["logprob"] for d in sorted(answer["data"], key=lambda d: d["index"])]


__all__ = ["CallError", "ChatResult", "ChatStream", "Client"]
