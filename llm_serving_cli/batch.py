"""`llm-serving batch submit FILE --model M`, `status BATCH_ID`, `results BATCH_ID`: the Batch API (docs/batch.md)
through the official `openai` client, with a progress bar while a batch runs.

The server is `--url` (default $LLM_SERVING_URL, else `make up`'s http://127.0.0.1:9000), the key $LLM_SERVING_API_KEY
(or $OPENAI_API_KEY). Nothing here talks to the store: a client team runs exactly what this command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)
TERMINAL = ("completed", "failed", "expired", "cancelled")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score")


class BatchInputError(ValueError):
    pass


def _client(url: str):
    import openai

    key = os.environ.get("LLM_SERVING_API_KEY") or os.environ.get("OPENAI_API_KEY") or "no-key"
    return openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=key, max_retries=2)


def prepare_lines(text: str, model: str, endpoint: str) -> bytes:
    """The file as the server gets it: each line's body names `model` (filled in where the line names none; a line
    naming another model is refused here, naming the line, rather than sent to fail). Envelope problems are left to
    the server, which turns them into error lines."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            out.append(line)  # the server reports it as an error line naming the line
            continue
        body = value.get("body") if isinstance(value, dict) else None
        if isinstance(body, dict):
            if body.get("model") not in (None, model):
                raise BatchInputError(f"line {number}: body.model is {body['model']!r}, not --model {model!r}")
            body["model"] = model
        if isinstance(value, dict):
            value.setdefault("method", "POST")
            value.setdefault("url", endpoint)
        out.append(json.dumps(value))
    if not out:
        raise BatchInputError("the file holds no request line")
    return ("\n".join(out) + "\n").encode()


def watch(client, batch_id: str, poll_s: float = 1.0):
    """A progress bar over the batch's request_counts until it ends; returns the last batch object."""
    batch = client.batches.retrieve(batch_id)
    columns = (TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(batch_id, total=batch.request_counts.total or None, status=batch.status, failed=0)
        while True:
            counts = batch.request_counts
            progress.update(task, completed=counts.completed + counts.failed, total=counts.total or None,
                            status=batch.status, failed=counts.failed)
            if batch.status in TERMINAL:
                return batch
            time.sleep(poll_s)
            batch = client.batches.retrieve(batch_id)


def _describe(batch) -> str:
    counts = batch.request_counts
    return (f"{batch.id} {batch.status}: {counts.completed} completed, {counts.failed} failed of {counts.total}; "
            f"output {batch.output_file_id or '-'}, errors {batch.error_file_id or '-'}")


def cmd_submit(args: argparse.Namespace) -> int:
    content = prepare_lines(Path(args.file).read_text(), args.model, args.endpoint)
    client = _client(args.url)
    uploaded = client.files.create(file=(Path(args.file).name, content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=args.endpoint, completion_window="24h")
    print(batch.id)
    console.print(f"[green]submitted[/] {batch.id} ({batch.request_counts.total} requests, file {uploaded.id})")
    if args.wait:
        console.print(_describe(watch(client, batch.id)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args.url)
    batch = watch(client, args.batch_id) if args.wait else client.batches.retrieve(args.batch_id)
    print(_describe(batch))
    return 0 if batch.status != "failed" else 1


def cmd_results(args: argparse.Namespace) -> int:
    client = _client(args.url)
    batch = client.batches.retrieve(args.batch_id)
    if batch.status not in TERMINAL:
        console.print(f"[yellow]{batch.id} is {batch.status}[/]: results come when it ends (status --wait)")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for kind, file_id in (("output", batch.output_file_id), ("errors", batch.error_file_id)):
        if file_id:
            path = out / f"{batch.id}_{kind}.jsonl"
            path.write_bytes(client.files.content(file_id).content)
            console.print(f"[green]{kind}[/] {path}")
    print(_describe(batch))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-serving batch", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("LLM_SERVING_URL", "http://127.0.0.1:9000"),
                        help="the OpenAI front-end (default $LLM_SERVING_URL or http://127.0.0.1:9000)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="upload a JSONL file and create a batch on it")
    p.add_argument("file", type=Path)
    p.add_argument("--model", required=True, help="the served model id every line's body names")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/chat/completions")
    p.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("status", help="a batch's state and counts")
    p.add_argument("batch_id")
    p.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("results", help="download a finished batch's output and error files")
    p.add_argument("batch_id")
    p.add_argument("--out", default=".", help="directory for <batch>_output.jsonl and <batch>_errors.jsonl")
    p.set_defaults(func=cmd_results)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    import openai

    try:
        return args.func(args)
    except BatchInputError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    except openai.APIStatusError as exc:
        console.print(f"[red]error {exc.status_code}:[/] {exc.message}")
        return 2
    except openai.APIConnectionError as exc:
        console.print(f"[red]error:[/] cannot reach {args.url}: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
