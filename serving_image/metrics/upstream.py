"""Fetch and parse the upstream exposition (Triton's metrics port, or the embedded Triton's metrics served on it).

The fetch has a total deadline (not only a per-read socket timeout, so an upstream that trickles bytes cannot hold
a scrape) and a body cap. Every failure is returned as an `UpstreamResult` with a short `reason` (a label of the
proxy's scrape-error counter) and a `detail` for the log; nothing raises into the proxy's request handler.
"""

from __future__ import annotations

import http.client
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal

from serving_image.metrics.exposition import ExpositionError, Family, parse_text

ErrorReason = Literal["timeout", "connection", "http_status", "too_large", "parse", "bad_url"]
ERROR_REASONS: tuple[str, ...] = ("timeout", "connection", "http_status", "too_large", "parse", "bad_url")

# Triton serves Prometheus text 0.0.4 only; ask for exactly that.
_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_CHUNK = 64 * 1024


@dataclass
class UpstreamResult:
    families: list[Family] = field(default_factory=list)
    error: ErrorReason | None = None
    detail: str = ""
    duration_s: float = 0.0
    body_bytes: int = 0

    @property
    def up(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class UpstreamTarget:
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> UpstreamTarget:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream URL must be http://host[:port]/path, got {url!r}")
        path = parts.path or "/metrics"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.hostname, parts.port or 80, path)


def fetch_upstream(url: str, *, timeout_s: float, max_bytes: int) -> UpstreamResult:
    """GET `url` within `timeout_s` seconds in total, reading at most `max_bytes`, and parse it."""
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        target = UpstreamTarget.parse(url)
    except ValueError as exc:
        return UpstreamResult(error="bad_url", detail=str(exc))
    conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout_s)
    try:
        conn.request("GET", target.path, headers={"Accept": _ACCEPT, "Accept-Encoding": "identity"})
        # Keep the socket: http.client drops `conn.sock` once the response says the connection will close.
        sock = conn.sock
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        response = conn.getresponse()
        if response.status != 200:
            return UpstreamResult(
                error="http_status", detail=f"{url} answered HTTP {response.status} {response.reason}",
                duration_s=time.monotonic() - start,
            )
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return UpstreamResult(
                error="too_large", detail=f"{url} declared {declared} bytes, over the {max_bytes}-byte cap",
                duration_s=time.monotonic() - start,
            )
        chunks: list[bytes] = []
        size = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            chunk = response.read1(_CHUNK) if hasattr(response, "read1") else response.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                return UpstreamResult(
                    error="too_large", detail=f"{url} sent more than the {max_bytes}-byte cap",
                    duration_s=time.monotonic() - start, body_bytes=size,
                )
            chunks.append(chunk)
    except TimeoutError:
        return UpstreamResult(
            error="timeout", detail=f"{url} did not answer within {timeout_s:g} s",
            duration_s=time.monotonic() - start,
        )
    except (OSError, http.client.HTTPException) as exc:
        return UpstreamResult(
            error="connection", detail=f"{url}: {type(exc).__name__}: {exc}", duration_s=time.monotonic() - start
        )
    finally:
        conn.close()
    body = b"".join(chunks)
    result = parse_exposition(body)
    result.duration_s = time.monotonic() - start
    result.body_bytes = size
    if result.error:
        result.detail = f"{url}: {result.detail}"
    return result


def parse_exposition(body: bytes) -> UpstreamResult:
    """Parse Prometheus text 0.0.4. A body that does not parse is rejected whole: half a scrape misleads."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return UpstreamResult(error="parse", detail=f"body is not UTF-8 ({exc})")
    try:
        families = parse_text(text)
    except ExpositionError as exc:
        return UpstreamResult(error="parse", detail=f"not Prometheus text 0.0.4: {exc}")
    return UpstreamResult(families=families)
