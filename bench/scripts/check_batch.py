"""`make check-batch`: a 1,000-line batch through the official `openai` client against `make up`, to completion,
with its worker killed mid-batch and, separately, the whole server restarted mid-batch.

Not part of `make test` (its time budget): a check of its own, like `make check-up-modes`.

1. `make up` (the demo model, its Batch API on a fresh directory store under --out, its worker started and restarted
   by `llm-serving up` as a Deployment restarts a pod);
2. a 1,000-line file: GOOD greedy chat requests and BAD lines of five kinds (a refused field, an out-of-range value,
   an unknown field, a wrong url, streaming), uploaded with `files.create` and run with `batches.create`;
3. once KILL_AT lines are stored, the worker is SIGKILLed (its pid file); `up` starts another;
4. once RESTART_AT lines are stored, `make up` is stopped as Ctrl-C stops it and started again on the same store;
5. once the batch is `completed`: every custom_id exactly once in the output and error files, each greedy output
   equal to the real-time answer to the same request, each bad line an error line naming its field, and a repeated
   request answered from the cache through llm_serving's reader, flagged as a hit.

Writes logs and summary.json under --out (default .cache/check-batch); exits 1 naming what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from make_up_modes import OPENAI_PORT, CheckFailed, _busy_ports, stop, wait_ready

from llm_serving.repository import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from llm_serving.batch_cache import ResultCache  # noqa: E402
from llm_serving.object_store import DirectoryStore  # noqa: E402
from serving_image.batch.storage import BatchStorage  # noqa: E402

MODEL = "demo-tiny"
CHAT = "/v1/chat/completions"
LINES = 1000
KILL_AT = 300
RESTART_AT = 600
URL = f"http://127.0.0.1:{OPENAI_PORT}"
PID_FILE = REPO_ROOT / ".cache" / "llm-serving" / "batch-worker.pid"
BAD_KINDS = {  # custom_id prefix -> (how the line is spoiled, the field its error must name)
    "bad-tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "bad-temperature": ({"temperature": 7}, "temperature"),
    "bad-field": ({"frobnicate": True}, "frobnicate"),
    "bad-url": (None, "url"),
    "bad-stream": ({"stream": True}, "body.stream"),
}


def build_lines() -> list[dict]:
    """LINES lines; every 20th a bad one (50 in all), the kinds in turn."""
    lines = []
    kinds = list(BAD_KINDS)
    for i in range(LINES):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"catalog title {i}: a summary"}],
                "temperature": 0, "max_tokens": 8}
        line = {"custom_id": f"ok-{i}", "method": "POST", "url": CHAT, "body": body}
        if i % 20 == 19:
            kind = kinds[(i // 20) % len(kinds)]
            spoil, _ = BAD_KINDS[kind]
            line["custom_id"] = f"{kind}-{i}"
            if spoil is None:
                line["url"] = "/v1/embeddings"
            else:
                body.update(spoil)
        lines.append(line)
    return lines


def start_up(out: Path, store: Path, index: int, command: list[str]) -> tuple[subprocess.Popen, Path]:
    if _busy_ports():
        raise CheckFailed(f"ports in use before `make up`: {', '.join(_busy_ports())}")
    log = out / f"up-{index}.log"
    env = dict(os.environ, COLUMNS="240", LLM_SERVING_BATCH_STORE=str(store))
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    wait_ready(proc, "openai", log, 1800)
    return proc, log


def stored(store: Path, batch_id: str) -> int:
    """Lines with a stored result (the worker stores them in chunks: serving_image/batch/result_writer.py)."""
    return len(BatchStorage(DirectoryStore(store)).done_indexes(batch_id))


def wait_stored(store: Path, batch_id: str, count: int, timeout: float = 3600) -> None:
    deadline = time.monotonic() + timeout
    while stored(store, batch_id) < count:
        if time.monotonic() > deadline:
            raise CheckFailed(f"only {stored(store, batch_id)} of {count} lines stored after {timeout:.0f}s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".cache" / "check-batch")
    parser.add_argument("--up", default="make up",
                        help="the command that serves (default `make up`; e.g. `.venv-serving/bin/llm-serving up` "
                             "where the environments are current)")
    args = parser.parse_args(argv)
    command = args.up.split()
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    store = out / "batch-store"
    summary: dict = {"lines": LINES}
    lines = build_lines()
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="none", max_retries=2, timeout=600)
    proc, log = start_up(out, store, 1, command)
    try:
        t0 = time.monotonic()
        uploaded = client.files.create(file=("catalog.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        summary["batch_id"] = batch.id
        wait_stored(store, batch.id, KILL_AT)
        pid = int(PID_FILE.read_text())
        os.kill(pid, signal.SIGKILL)
        summary["worker_killed_at"] = stored(store, batch.id)
        wait_stored(store, batch.id, RESTART_AT)
        summary["server_stopped_at"] = stored(store, batch.id)
        stop(proc, log, 120)
        summary["stored_after_stop"] = stored(store, batch.id)
        proc, log = start_up(out, store, 2, command)
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired",
                                                                          "cancelled"):
            time.sleep(1)
        summary["batch_wall_s"] = round(time.monotonic() - t0, 1)
        summary["status"] = done.status
        summary["request_counts"] = done.request_counts.model_dump()
        if done.status != "completed":
            raise CheckFailed(f"batch ended {done.status}: {done}")

        outputs = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
        ids = [x["custom_id"] for x in outputs + errors]
        if sorted(ids) != sorted(x["custom_id"] for x in lines) or len(set(ids)) != LINES:
            raise CheckFailed(f"custom_ids not answered exactly once: {len(ids)} lines, {len(set(ids))} distinct")
        by_id = {x["custom_id"]: x for x in outputs}
        mismatches = []
        for line in lines:
            if line["custom_id"].startswith("ok-"):
                realtime = client.chat.completions.create(**line["body"]).choices[0].message.content
                if by_id[line["custom_id"]]["response"]["body"]["choices"][0]["message"]["content"] != realtime:
                    mismatches.append(line["custom_id"])
        summary["greedy_equal_realtime"] = f"{len(outputs) - len(mismatches)}/{len(outputs)}"
        if mismatches:
            raise CheckFailed(f"batch outputs differ from real-time answers: {mismatches[:10]}")
        for error in errors:
            kind = error["custom_id"].rsplit("-", 1)[0]
            field = BAD_KINDS[kind][1]
            named = (error["error"] or {}).get("param") or (error["response"] or {}).get("body", {}).get(
                "error", {}).get("param")
            if named != field:
                raise CheckFailed(f"{error['custom_id']}: error line names {named!r}, not {field!r}: {error}")
        summary["bad_lines_named"] = len(errors)

        version = httpx.get(f"{URL}/health/ready", timeout=30).json()["version"]
        lookup = ResultCache(DirectoryStore(store)).get(MODEL, version, CHAT, lines[0]["body"])
        if not lookup.hit:
            raise CheckFailed(f"no cache hit for {lines[0]['custom_id']}: {lookup.why_miss}")
        summary["cache_hit"] = {"key": lookup.key, "hit": lookup.hit}
    finally:
        if proc.poll() is None:
            stop(proc, log, 120)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckFailed as exc:
        print(f"check-batch failed: {exc}", file=sys.stderr)
        sys.exit(1)
