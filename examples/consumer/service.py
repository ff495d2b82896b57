"""The example client service's program (docs/clients.md): everything a service does with llm_serving_client, from
the stack-outputs file its deployment (this directory's Pulumi program) mounts.

    python examples/consumer/service.py --outputs /etc/llm-serving/stack-outputs.json --llm chat-large \\
        --ranker ranker --experiment chat-temperature [--in-process ranker-features=1.0.0=/path/to/package]

For a local server (`make up`, the tests) every route goes to one address: --local-openai http://localhost:9000/v1
--local-grpc localhost:8001; with --discover-local (no stack there) the document is asked from the server:

    python examples/consumer/service.py --local-openai http://localhost:9000/v1 --local-grpc localhost:8001 \\
        --discover-local --llm demo-tiny --ranker ranker --experiment demo-temperature \\
        --in-process ranker-features=<its published package directory>

It streams a generation, asks for a JSON answer (`response_format`), ranks rows remotely,
runs each `--in-process` model here and remotely and checks the answers agree, sends one call per unit of an
experiment and prints its per-arm figures, and with --read-cache answers from the batch path's cache first. It prints
one JSON summary; the per-stage records go to the `llm_serving_client.calls` log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from llm_serving.stack_outputs import StackOutputs, parse_stack_outputs
from llm_serving_client import Client, LocalEndpoints, load_outputs
from llm_serving_client.local import DEMO_EXPERIMENT, describe_local_server

MESSAGES = [{"role": "user", "content": "Say hello"}]
GREETING = {"type": "json_schema", "json_schema": {"name": "greeting", "schema": {
    "type": "object", "properties": {"greeting": {"type": "string", "maxLength": 12}}, "required": ["greeting"],
    "additionalProperties": False}}}


def rows(count: int, width: int = 8) -> np.ndarray:
    """Fixed non-negative FP32 rows (the ranker's features, the pipeline step's raw counts)."""
    return (np.arange(count * width, dtype=np.float32).reshape(count, width) % 7) / 7


def _in_process_specs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """MODEL=VERSION=PACKAGE, or MODEL=PACKAGE against a local server (its one version)."""
    specs = []
    from llm_serving.package import open_package

    for spec in args.in_process:
        parts = spec.split("=", 2)
        if len(parts) == 2 and args.discover_local:  # the package's own version: a local server names none
            parts = [parts[0], open_package(Path(parts[1])).manifest.model.version, parts[1]]
        if len(parts) != 3:
            raise SystemExit(f"--in-process {spec!r}: MODEL=VERSION=PACKAGE (MODEL=PACKAGE with --discover-local)")
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


def run(args: argparse.Namespace) -> dict:
    local = LocalEndpoints(args.local_openai, args.local_grpc) if args.local_openai else None
    specs = _in_process_specs(args)
    outputs = _outputs(args, specs)
    cache = None
    if args.read_cache:  # the stack's batch.cache, as Client.from_file(read_cache=True) opens it
        cache = Client.from_file(args.outputs, read_cache=True)._cache
    client = Client(outputs, api_key=args.api_key, local=local, result_cache=cache)
    summary: dict = {"stack": client.discovery.outputs.stack}
    try:
        if args.llm:
            stream = client.chat(args.llm, MESSAGES, max_tokens=8, temperature=0, stream=True)
            summary["streamed"] = {"deltas": len(list(stream)), "text": stream.text,
                                   "finish_reason": stream.finish_reason}
            summary["json"] = json.loads(client.chat(args.llm, MESSAGES, max_tokens=120,
                                                     response_format=GREETING).text)
            if args.read_cache:
                answer = client.chat(args.llm, MESSAGES, max_tokens=8, temperature=0, cached=True)
                summary["cached"] = {"hit": answer.cached, "text": answer.text}
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
    parser.add_argument("--read-cache", action="store_true", help="answer from the batch path's cache first")
    parser.add_argument("--discover-local", action="store_true",
                        help="no stack outputs: describe the local server's models (llm_serving_client.local), with "
                             f"the demo experiment {DEMO_EXPERIMENT!r} on --llm when --experiment names it")
    args = parser.parse_args(argv)
    if bool(args.local_openai) != bool(args.local_grpc):
        parser.error("--local-openai and --local-grpc go together")
    if args.discover_local and not args.local_openai:
        parser.error("--discover-local describes a local server: give --local-openai and --local-grpc")
    if args.discover_local and args.read_cache:
        parser.error("--read-cache reads a stack's batch cache: give --outputs, not --discover-local")
    summary = run(args)
    json.dump(summary, sys.stdout, indent=1)
    print()
    return summary


if __name__ == "__main__":
    main()
