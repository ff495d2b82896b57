"""`make check-up-modes`: `make up`, then `make up MODE=standalone`, then `make up` again, each until it serves.

The second run used to fail, its ranker packaged with other bytes under the version the first had
published (versions are immutable). Every package `make up` builds now has a version derived from its bytes
(dev_packages/versions.py); this is the check, on a clone, that the three runs serve. It is not part of
`make test` (three engine starts, minutes each): run it on its own, e.g. as a CI step of its own.

Each run is `make up` in a process group of its own (the fixed ports of llm_serving/pod_contract.py: OpenAI 9000,
KServe 8000/8001, metrics 8002 and 8004), waited for until Triton's readiness (and, in `openai` mode, the OpenAI
front-end's) answers 200 and the log says "startup complete"; then it must serve:
  - openai mode: a completion through the official `openai` client on :9000;
  - both modes: the LLM streamed over KServe v2 gRPC (`tritonclient`, ModelStreamInfer) on :8001, and the ranker and
    its pipeline (an ensemble) through KServe v2 gRPC;
and it is stopped as Ctrl-C stops it (SIGINT to the whole process group): every process of the group must be gone,
the log free of tracebacks and every port closed before the next run. The versions the runs served are compared:
the first and the third the same (their packages found already published, identical), the second all different.

Writes the runs' logs and summary.json under --out (default .cache/check-up-modes); exits 1 naming what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from llm_serving import pod_contract as pc
from llm_serving.kserve_stream import until_final
from llm_serving.ports import accepts

DEMO_LLM = "demo-tiny"
RANKER, PIPELINE = "ranker", "ranker-pipeline"
N_FEATURES = 8
OPENAI_PORT = pc.PORTS[pc.OPENAI_PORT_NAME]
KSERVE_HTTP_PORT = pc.PORTS[pc.KSERVE_HTTP_PORT_NAME]
KSERVE_GRPC_PORT = pc.PORTS[pc.KSERVE_GRPC_PORT_NAME]
PORTS = {**pc.PORTS, "triton-metrics": pc.TRITON_METRICS_PORT}
RUNS = (("openai", []), ("standalone", ["MODE=standalone"]), ("openai", []))
# The lines `llm-serving up` prints once it serves (llm_serving_cli/main.py, _print_ready) and when a package was
# published before with the same bytes (_print_published).
SERVED_LINE = re.compile(r"^\s*model\s+(?P<id>[a-z0-9-]+) (?P<version>\S+) (?P<backend>\([^)]+\))\s*$", re.M)
REPUBLISHED_LINE = re.compile(r"^already published \(identical\) (?P<id>[a-z0-9-]+) ", re.M)


class CheckFailed(RuntimeError):
    """A run did not serve, or did not stop cleanly; the message says which and how."""


@dataclass
class RunResult:
    run: int
    mode: str
    command: str
    ready_s: float = 0.0
    stop_s: float = 0.0
    make_rc: int | None = None
    served: dict[str, str] = field(default_factory=dict)
    republished: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    log: str = ""


def _busy_ports() -> list[str]:
    return [f"{name} :{port}" for name, port in PORTS.items() if accepts(port)]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _ready(mode: str) -> bool:
    urls = [f"http://127.0.0.1:{KSERVE_HTTP_PORT}/v2/health/ready"]
    if mode == "openai":
        urls.append(f"http://127.0.0.1:{OPENAI_PORT}/health/ready")
    try:
        return all(httpx.get(url, timeout=5).status_code == 200 for url in urls)
    except httpx.HTTPError:
        return False


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


def wait_ready(proc: subprocess.Popen, mode: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed(f"`make up` exited with {proc.returncode} before serving:\n{_tail(log)}")
        if "startup complete" in log.read_text(errors="replace") and _ready(mode):
            return
        time.sleep(1)
    raise CheckFailed(f"not serving after {timeout:.0f}s:\n{_tail(log)}")


def _openai_completion() -> str:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{OPENAI_PORT}/v1", api_key="unused", timeout=120)
    done = client.completions.create(model=DEMO_LLM, prompt="Say hello", max_tokens=8, temperature=0)
    if len(done.choices) != 1 or done.usage is None or done.usage.completion_tokens < 1:
        raise CheckFailed(f"openai completion: unexpected answer {done!r}")
    return f"openai completion on :{OPENAI_PORT}: {done.usage.completion_tokens} tokens"


def _kserve_llm_stream() -> str:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{KSERVE_GRPC_PORT}")
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
              grpcclient.InferInput("sampling_parameters", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([b"Say hello"], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True]))
    inputs[2].set_data_from_numpy(np.array([b'{"max_tokens": 6, "temperature": 0}'], dtype=np.object_))
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    pieces = 0
    try:
        client.async_stream_infer(DEMO_LLM, inputs, request_id="check-up-modes")
        for _result, error in until_final(responses, timeout=120):
            if error is not None:
                raise CheckFailed(f"KServe gRPC stream of {DEMO_LLM}: {error}")
            pieces += 1
    finally:
        client.stop_stream()
        client.close()
    return f"KServe v2 gRPC stream of {DEMO_LLM} on :{KSERVE_GRPC_PORT}: {pieces} responses"


def _kserve_ranker() -> list[str]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{KSERVE_GRPC_PORT}")
    rows = np.linspace(0.0, 1.0, 2 * N_FEATURES, dtype=np.float32).reshape(2, N_FEATURES)
    done = []
    try:
        for model, name, output in ((RANKER, "features", "score"), (PIPELINE, "raw", "relevance")):
            tensor = grpcclient.InferInput(name, list(rows.shape), "FP32")
            tensor.set_data_from_numpy(rows)
            got = client.infer(model, [tensor]).as_numpy(output)
            if got is None or got.shape != (2, 1) or not np.isfinite(got).all():
                raise CheckFailed(f"KServe {model}: output {output} is {got!r}, expected 2 finite rows")
            done.append(f"KServe v2 gRPC {model}: {output} {got.ravel().round(4).tolist()}")
    finally:
        client.close()
    return done


def stop(proc: subprocess.Popen, log: Path, timeout: float) -> float:
    """Ctrl-C as a terminal sends it (SIGINT to the whole group); the group must then empty and the ports close."""
    start = time.monotonic()
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGINT)
    deadline = start + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reaps `make` once it exits: a zombie still counts as a member of its group
        if not _group_alive(proc.pid):
            break
        time.sleep(0.2)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise CheckFailed(f"processes of `make up` still running {timeout:.0f}s after SIGINT (killed):\n{_tail(log)}")
    proc.wait(timeout=30)
    while time.monotonic() < deadline and _busy_ports():
        time.sleep(0.2)
    if _busy_ports():
        raise CheckFailed(f"ports still open after `make up` stopped: {', '.join(_busy_ports())}")
    return time.monotonic() - start


def run_once(index: int, mode: str, make_args: list[str], repo: Path, out: Path, start_timeout: float,
             stop_timeout: float) -> RunResult:
    command = ["make", "up", *make_args]
    log = out / f"{index}-{'-'.join(['up', *make_args]).lower().replace('=', '-')}.log"
    result = RunResult(index, mode, " ".join(command), log=str(log))
    if _busy_ports():
        raise CheckFailed(f"run {index}: ports in use before `{result.command}`: {', '.join(_busy_ports())}")
    # COLUMNS: rich would wrap the lines this script reads at 80 columns in a file.
    env = dict(os.environ, COLUMNS="240")
    start = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, cwd=repo, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        try:
            wait_ready(proc, mode, log, start_timeout)
            result.ready_s = round(time.monotonic() - start, 1)
            if mode == "openai":
                result.checks.append(_openai_completion())
            result.checks.append(_kserve_llm_stream())
            result.checks.extend(_kserve_ranker())
        finally:
            result.stop_s = round(stop(proc, log, stop_timeout), 1)
    except CheckFailed as exc:
        raise CheckFailed(f"run {index} (`{result.command}`): {exc}") from exc
    result.make_rc = proc.returncode
    text = log.read_text(errors="replace")
    if "Traceback" in text:
        raise CheckFailed(f"run {index} (`{result.command}`): a traceback in {log}:\n{_tail(log)}")
    result.served = {m["id"]: m["version"] for m in SERVED_LINE.finditer(text)}
    result.republished = sorted(m["id"] for m in REPUBLISHED_LINE.finditer(text))
    return result


def compare_versions(results: list[RunResult]) -> None:
    first, second, third = (r.served for r in results)
    if len(first) != 5 or set(second) != set(first):
        raise CheckFailed(f"the runs served other models: {first} / {second}")
    if third != first:
        raise CheckFailed(f"`make up` twice served other versions: {first} then {third}")
    same = sorted(i for i in first if second[i] == first[i])
    if same:
        raise CheckFailed(f"both serving modes served the same version of {', '.join(same)}")
    if results[2].republished != sorted(first):
        raise CheckFailed(f"the third run republished only {results[2].republished}, not all of {sorted(first)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the clone to run `make up` in")
    parser.add_argument("--out", type=Path, default=None, help="logs and summary.json (default REPO/.cache/...)")
    parser.add_argument("--start-timeout", type=float, default=1200.0,
                        help="seconds each run may take to serve (the first builds the demo model)")
    parser.add_argument("--stop-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    out = (args.out or repo / ".cache" / "check-up-modes").resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    try:
        for index, (mode, make_args) in enumerate(RUNS, 1):
            result = run_once(index, mode, make_args, repo, out, args.start_timeout, args.stop_timeout)
            results.append(result)
            print(f"run {index} `{result.command}`: serving after {result.ready_s}s, stopped in {result.stop_s}s; "
                  f"{'; '.join(result.checks)}", flush=True)
        compare_versions(results)
    except CheckFailed as exc:
        (out / "summary.json").write_text(json.dumps({"ok": False, "error": str(exc),
                                                      "runs": [asdict(r) for r in results]}, indent=2))
        print(f"check-up-modes FAILED: {exc}", file=sys.stderr)
        return 1
    (out / "summary.json").write_text(json.dumps({"ok": True, "runs": [asdict(r) for r in results]}, indent=2))
    print(f"check-up-modes: the three runs served; versions {results[0].served} (openai), {results[1].served} "
          f"(standalone); summary {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
