"""Continuous load through the gateway while a rollout scenario runs: a bounded number of clients on
loopback, each sending one OpenAI completion after another through the proxy's HTTPS listener (the model's
hostname as Host and SNI, the rehearsal's CA trusted), alternating streamed and whole answers.

Every request is judged as a client would: a non-200 answer, a connection error or a timeout is a failure; a stream
that ends without a choice's `finish_reason` and the `[DONE]` event is a cut-short stream, counted as a failure too
(it is the silent partial answer that clients cannot tell from a short one). Each outcome is kept with its time for
the report's plot.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from rehearsal import secrets

PROMPTS = ("The platform serves", "Red-black rollouts move traffic", "A model server answers")
MAX_TOKENS = 6


@dataclass
class Outcome:
    at: float  # seconds since the load began
    ok: bool
    streamed: bool
    detail: str = ""


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def requests(self) -> int:
        return len(self.outcomes)

    @property
    def failed(self) -> int:
        return sum(not o.ok for o in self.outcomes)

    def failures(self, limit: int = 10) -> list[str]:
        return [f"{o.at:.1f}s {'stream' if o.streamed else 'whole'}: {o.detail}" for o in self.outcomes
                if not o.ok][:limit]


def judge_stream(lines: list[str]) -> str:
    """'' when a streamed completion ended as it should, else why it is cut short."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not events or events[-1].strip() != "[DONE]":
        return "cut short: no [DONE] event"
    finished = False
    for event in events[:-1]:
        body = json.loads(event)
        if "error" in body:
            return f"error event: {body['error']}"
        finished = finished or any(c.get("finish_reason") for c in body.get("choices") or [])
    return "" if finished else "cut short: no finish_reason before [DONE]"


async def _one(client: httpx.AsyncClient, url: str, host: str, model: str, prompt: str, stream: bool) -> str:
    """'' on success, else what went wrong."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    headers = {"Host": host}
    extensions = {"sni_hostname": host}
    try:
        if not stream:
            response = await client.post(url, json=body, headers=headers, extensions=extensions)
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.text[:200]}"
            choices = response.json().get("choices") or []
            return "" if choices and choices[0].get("finish_reason") else "no finish_reason"
        async with client.stream("POST", url, json=body, headers=headers, extensions=extensions) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            lines = [line async for line in response.aiter_lines()]
        return judge_stream(lines)
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return f"{type(err).__name__}: {err}"


async def run_load(port: int, host: str, model: str, verify, stop: asyncio.Event, result: LoadResult,
                   clients: int = 2, pause_s: float = 1.0) -> None:
    """Until `stop` is set; each client waits `pause_s` between requests (a bounded load: on the 2-core machine a
    new pod's engine must still start while the old ones serve it)."""
    url = f"https://127.0.0.1:{port}/v1/completions"

    async def client_loop(index: int) -> None:
        async with httpx.AsyncClient(verify=verify, timeout=120, headers=secrets.auth_headers()) as client:
            n = 0
            while not stop.is_set():
                stream = (n + index) % 2 == 0
                error = await _one(client, url, host, model, PROMPTS[n % len(PROMPTS)], stream)
                result.outcomes.append(Outcome(time.monotonic() - result.started, not error, stream, error))
                n += 1
                try:  # asyncio.timeout: 3.11's wait_for can swallow a cancel (kubelet.http_probe)
                    async with asyncio.timeout(pause_s):
                        await stop.wait()
                except TimeoutError:
                    pass

    await asyncio.gather(*(client_loop(i) for i in range(clients)))


async def run_kserve_load(port: int, host: str, model: str, body: dict, outputs: list[str], verify,
                          stop: asyncio.Event, result: LoadResult, pause_s: float = 1.0) -> None:
    """One client sending KServe v2 `infer` (JSON) through the gateway until `stop`; an answer must be 200 and hold
    every output in `outputs` (a request that names outputs gets exactly those)."""
    url = f"https://127.0.0.1:{port}/v2/models/{model}/infer"
    async with httpx.AsyncClient(verify=verify, timeout=60, headers=secrets.auth_headers()) as client:
        while not stop.is_set():
            error = ""
            try:
                response = await client.post(url, json=body, headers={"Host": host},
                                             extensions={"sni_hostname": host})
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    got = {o["name"] for o in response.json().get("outputs") or []}
                    if missing := [o for o in outputs if o not in got]:
                        error = f"outputs {missing} missing from the answer (got {sorted(got)})"
            except (httpx.HTTPError, json.JSONDecodeError) as err:
                error = f"{type(err).__name__}: {err}"
            result.outcomes.append(Outcome(time.monotonic() - result.started, not error, False, error))
            try:  # asyncio.timeout: 3.11's wait_for can swallow a cancel (kubelet.http_probe)
                async with asyncio.timeout(pause_s):
                    await stop.wait()
            except TimeoutError:
                pass
