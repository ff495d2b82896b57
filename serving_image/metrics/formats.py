"""Content negotiation between Prometheus text 0.0.4 and OpenMetrics 1.0."""

from __future__ import annotations

from serving_image.metrics.exposition import CONTENT_TYPE_OPENMETRICS, CONTENT_TYPE_TEXT, Family, write_text
from serving_image.metrics.openmetrics import write_openmetrics


def negotiate(accept: str | None) -> tuple[str, str]:
    """Pick ('openmetrics' | 'text', content type) from an Accept header, honouring q-values.

    OpenMetrics 1.0.0 and 0.0.1 are served as 1.0.0; anything else (or no header) gets text 0.0.4, which every
    Prometheus understands.
    """
    best = ("text", 0.0)
    for media_range in (accept or "").split(","):
        parts = [p.strip() for p in media_range.split(";")]
        kind = parts[0].lower()
        params = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        try:
            q = float(params.get("q", "1"))
        except ValueError:
            q = 0.0
        if kind == "application/openmetrics-text" and params.get("version", "1.0.0") in ("1.0.0", "0.0.1"):
            if q > best[1]:
                best = ("openmetrics", q)
        elif kind in ("text/plain", "*/*", "text/*") and q > best[1]:
            best = ("text", q)
    if best[0] == "openmetrics":
        return "openmetrics", CONTENT_TYPE_OPENMETRICS
    return "text", CONTENT_TYPE_TEXT


def render(families: list[Family], fmt: str) -> bytes:
    if fmt == "openmetrics":
        return write_openmetrics(families)
    if fmt == "text":
        return write_text(families)
    raise ValueError(f"format must be 'text' or 'openmetrics', got {fmt!r}")
