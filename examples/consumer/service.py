"""The example client service's program (docs/clients.md): everything a service does with llm_serving_client, from
the stack-outputs file its deployment (this directory's Pulumi program) mounts.

    python examples/consumer/service.py --outputs /etc/llm-serving/stack-outputs.json --llm chat-large \\
        --ranker ranker --experiment chat-temperature [--in-process ranker-features=1.0.0=/path/to/package]

For a local server (`make up`, the tests) every route goes to one address: --local-openai http://localhost:9000/v1
--local-grpc localhost:8001; with --discover-local (no stack there) the document is asked from the server:

    python examples/consumer/service.py --local-openai http://localhost:9000/v1 --local-grpc localhost:8001 \\
        --discover-local --llm demo-tiny --ranker ranker --experiment demo-temperature --read-cache \\
        --in-process ranker --in-process ranker-features   # the packages `make up` serves (its served.json)

It streams a generation, asks for a JSON answer (`response_format`), ranks rows remotely,
runs each `--in-process` model here and remotely and checks the answers agree, sends one call per unit of an
experiment and prints its per-arm figures. With --read-cache it submits a small batch of greedy chat requests with the
official `openai` client (the Files and Batches API, docs/batch.md), waits for it, asks each request again with
`cached=True` and checks each is a cache hit equal to the batch's output line, and that a request no batch ran is a
miss. It prints one JSON summary; the per-stage records go to the `llm_serving_client.calls` log.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import openai

from llm_serving.batch_cache import ResultCache
from llm_serving.stack_outputs import StackOutputs, parse_stack_outputs
from llm_serving_client import Client, LocalEndpoints, load_outputs
from llm_serving_client.local import DEMO_EXPERIMENT, describe_local_server, local_result_cache

MESSAGES = [{"role": "user", "content": "Say hello"}]
# The batch --read-cache submits: greedy, so the worker caches every answer (llm_serving/batch_cache.py).
BATCH_PROMPTS = ("Say hello", "Name a colour", "Count to three")
BATCH_PARAMETERS = {"max_tokens": 8, "temperature": 0}
BATCH_DONE = ("completed", "failed", "expired", "cancelled")
GREETING = {"type": "json_schema", "json_schema": {"name": "greeting", "schema": {
    "type": "object", "properties": {"greeting": {"type": "string", "maxLength": 12}}, "required": ["greeting"],
    "additionalProperties": False}}}


def rows(count: int, width: int = 8) -> np.ndarray:
    """Fixed non-negative FP32 rows (the ranker's features, the pipeline step's raw counts)."""
    return (np.arange(count * width, dtype=np.float32).reshape(count, width) % 7) / 7


def _in_process_specs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """MODEL=VERSION=PACKAGE; against a local server also MODEL=PACKAGE (the package's own version), or MODEL alone:
    the package `make up` serves for it (llm_serving/up_layout.py's served.json)."""
    specs = []
    from llm_serving.package import open_package
    from llm_serving.up_layout import served_package

    for spec in args.in_process:
        parts = spec.split("=", 2)
        if len(parts) == 1 and args.discover_local:
            try:
                version, package = served_package(parts[0])
            except ValueError as exc:
                raise SystemExit(f"--in-process {spec!r}: {exc}") from None
            parts = [parts[0], version, str(package)]
        if len(parts) == 2 and args.discover_local:  # the package's own version: a local server names none
            parts = [parts[0], open_package(Path(parts[1])).manifest.model.version, parts[1]]
        if len(parts) != 3:
            raise SystemExit(f"--in-process {spec!r}: MODEL=VERSION=PACKAGE (MODEL=PACKAGE or MODEL with "
                             "--discover-local)")
        specs.append(tuple(parts))
    return specs


def _outputs(args: argparse.Namespace, specs) -> StackOutputs:
    if not args.discover_local:
        return load_outputs(args.outputs)
    from llm_serving.package import open_package

    marks = {model: (version, open_package(Path(package)).manifest.model.io_fingerprint)
             for model, version, package in specs}
    return parse_stack_outputs(describe_local_server(
        args.local_openai, args.local_grpc, api_key=args.api_key, in_process=marks,
        demo_experiment_on=args.llm if args.experiment == DEMO_EXPERIMENT else None))


def _result_cache(args: argparse.Namespace, outputs: StackOutputs) -> ResultCache | None:
    if not args.read_cache:
        return None
    if args.discover_local:  # the local server's batch store (make up's by default)
        return local_result_cache(outputs, args.local_batch_store)
    return Client.from_file(args.outputs, read_cache=True)._cache  # the stack's batch.cache, as from_file opens it


def _run_batch(args: argparse.Namespace, outputs: StackOutputs, local: LocalEndpoints | None) -> tuple[str, dict]:
    """Submit BATCH_PROMPTS as one batch through the official client, wait for it; (batch id, custom_id -> the
    output line's answer text)."""
    endpoint = local.openai if local is not None else outputs.batch.endpoint
    lines = [{"custom_id": f"consumer-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": args.llm, "messages": [{"role": "user", "content": prompt}], **BATCH_PARAMETERS}}
             for i, prompt in enumerate(BATCH_PROMPTS)]
    sdk = openai.OpenAI(base_url=endpoint, api_key=args.api_key or "none")
    try:
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = sdk.files.create(file=("consumer-batch.jsonl", io.BytesIO(data)), purpose="batch")
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                   completion_window="24h", metadata={"team": "consumer-example"})
        deadline = time.monotonic() + args.batch_timeout_s
        while batch.status not in BATCH_DONE:
            if time.monotonic() > deadline:
                raise SystemExit(f"batch {batch.id} is still {batch.status} after {args.batch_timeout_s:g} s: no "
                                 f"batch worker is running? (make up runs one; its log is "
                                 f".cache/llm-serving/batch-worker.log)")
            time.sleep(0.5)
            batch = sdk.batches.retrieve(batch.id)
        if batch.status != "completed" or batch.request_counts.failed:
            raise SystemExit(f"batch {batch.id} ended {batch.status} with {batch.request_counts.failed} failed "
                             f"lines (errors: {batch.errors})")
        answers = {}
        for text in sdk.files.content(batch.output_file_id).text.splitlines():
            line = json.loads(text)
            answers[line["custom_id"]] = line["response"]["body"]["choices"][0]["message"]["content"]
    finally:
        sdk.close()
    return batch.id, answers


def _cached_answers(client: Client, args: argparse.Namespace, outputs: StackOutputs,
                    local: LocalEndpoints | None) -> dict:
    """A batch's answers read back through `chat(cached=True)`: each a hit equal to its output line; and a request
    no batch ran (a fresh prompt) a miss, answered by the model."""
    batch_id, answers = _run_batch(args, outputs, local)
    hits = []
    for i, prompt in enumerate(BATCH_PROMPTS):
        answer = client.chat(args.llm, [{"role": "user", "content": prompt}], cached=True, **BATCH_PARAMETERS)
        expected = answers[f"consumer-{i}"]
        hits.append({"custom_id": f"consumer-{i}", "hit": answer.cached, "text": answer.text,
                     "equal": answer.text == expected})
    if not any(h["hit"] for h in hits):
        where = (args.local_batch_store or "make up's batch store") if args.discover_local else "the stack's cache"
        raise SystemExit(f"batch {batch_id} completed but {where} holds none of its answers: is it the store the "
                         f"server and its worker use (their LLM_SERVING_BATCH_STORE)? (--local-batch-store)")
    fresh = [{"role": "user", "content": f"Say hello ({uuid.uuid4().hex[:8]})"}]  # never batched: not cached
    miss = client.chat(args.llm, fresh, cached=True, **BATCH_PARAMETERS)
    return {"batch": batch_id, "answers": hits, "miss": {"hit": miss.cached, "text": miss.text}}


def run(args: argparse.Namespace) -> dict:
    local = LocalEndpoints(args.local_openai, args.local_grpc) if args.local_openai else None
    specs = _in_process_specs(args)
    outputs = _outputs(args, specs)
    client = Client(outputs, api_key=args.api_key, local=local, result_cache=_result_cache(args, outputs))
    summary: dict = {"stack": client.discovery.outputs.stack}
    try:
        if args.llm:
            stream = client.chat(args.llm, MESSAGES, max_tokens=8, temperature=0, stream=True)
            summary["streamed"] = {"deltas": len(list(stream)), "text": stream.text,
                                   "finish_reason": stream.finish_reason}
            summary["json"] = json.loads(client.chat(args.llm, MESSAGES, max_tokens=120,
                                                     response_format=GREETING).text)
            if args.read_cache:
                summary["cached"] = _cached_answers(client, args, outputs, local)
        if args.ranker:
            version = args.ranker_version
            summary["ranker"] = client.infer(args.ranker, {"features": rows(4)}, version=version)["score"] \
                .reshape(-1).round(4).tolist()
        for model, version, package in specs:
            remote = Client(outputs, api_key=args.api_key, local=local)
            client.load_in_process(model, version, package)
            inputs = {name: rows(4) for name in client.in_process_io(model, version).inputs}
            here, there = client.infer(model, inputs), remote.infer(model, inputs)
            remote.close()
            summary.setdefault("in_process", {})[model] = {
                "equal": all(np.array_equal(here[k], there[k]) for k in here), "outputs": sorted(here)}
        if args.experiment:
            for unit in (f"user-{i}" for i in range(args.units)):
                client.chat(experiment=args.experiment, unit=unit, messages=MESSAGES, max_tokens=2)
            summary["experiment"] = {arm: {"calls": s.calls, "errors": s.errors,
                                           "p50_ms": round((s.quantile(0.5) or 0) * 1000, 1)}
                                     for arm, s in client.experiment_stats(args.experiment).items()}
    finally:
        client.close()
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", help="the stack-outputs file (default: $LLM_SERVING_STACK_OUTPUTS)")
    parser.add_argument("--api-key")
    parser.add_argument("--local-openai", help="a local server's OpenAI base URL: every route goes there")
    parser.add_argument("--local-grpc", help="a local server's KServe gRPC target")
    parser.add_argument("--llm", help="the generation model")
    parser.add_argument("--ranker", help="a tensor model taking features FP32 [n, 8]")
    parser.add_argument("--ranker-version", help="its version (a versioned model)")
    parser.add_argument("--in-process", action="append", default=[], metavar="MODEL=VERSION=PACKAGE",
                        help="run MODEL VERSION here from its package, and check it against the remote answer")
    parser.add_argument("--experiment", help="an experiment of chat arms to send --units units through")
    parser.add_argument("--units", type=int, default=20)
    parser.add_argument("--read-cache", action="store_true",
                        help="run a small batch, then answer its requests from the batch path's result cache")
    parser.add_argument("--local-batch-store",
                        help="with --discover-local: the local server's batch store (default: make up's, "
                             "llm_serving/up_layout.py)")
    parser.add_argument("--batch-timeout-s", type=float, default=600.0,
                        help="how long --read-cache waits for its batch to complete")
    parser.add_argument("--discover-local", action="store_true",
                        help="no stack outputs: describe the local server's models (llm_serving_client.local), with "
                             f"the demo experiment {DEMO_EXPERIMENT!r} on --llm when --experiment names it")
    args = parser.parse_args(argv)
    if bool(args.local_openai) != bool(args.local_grpc):
        parser.error("--local-openai and --local-grpc go together")
    if args.discover_local and not args.local_openai:
        parser.error("--discover-local describes a local server: give --local-openai and --local-grpc")
    if args.read_cache and not args.llm:
        parser.error("--read-cache runs a batch of chat requests: give --llm")
    if args.local_batch_store and not args.discover_local:
        parser.error("--local-batch-store is a local server's: give --discover-local (a stack names its cache)")
    summary = run(args)
    json.dump(summary, sys.stdout, indent=1)
    print()
    return summary


if __name__ == "__main__":
    main()
