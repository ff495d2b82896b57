"""A small, exact model of Prometheus text 0.0.4, its parser, and writers for 0.0.4 and OpenMetrics 1.0.

Why not prometheus_client's parser and generators: they convert everything to OpenMetrics' internal form, and a
Triton counter such as `nv_inference_request_success` (no `_total`) comes back out as
`nv_inference_request_success_total`, a different series: dashboards written against Triton would stop matching.
Here the series names are kept exactly as the source wrote them.

The model is the 0.0.4 view: a family's name is the name in its `# TYPE` line (a prometheus_client counter `x`
becomes `x_total`, as its 0.0.4 exposition writes it). `openmetrics.py` writes the same model as OpenMetrics, and
`formats.py` picks one of the two for a request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "untyped": ("",),
    "summary": ("", "_sum", "_count"),
    "histogram": ("_bucket", "_sum", "_count"),
}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*')
_META = re.compile(r"#[ \t]+(HELP|TYPE)[ \t]+([^ \t]+)(?:[ \t]+(.*))?$")
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Labels = tuple[tuple[str, str], ...]

CONTENT_TYPE_TEXT = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class ExpositionError(ValueError):
    """The text is not valid Prometheus text 0.0.4; the message names the line."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Labels
    value: float
    timestamp_ms: int | None = None


@dataclass
class Family:
    name: str
    type: str
    help: str = ""
    samples: list[Sample] = field(default_factory=list)

    def sample_names(self) -> set[str]:
        return {self.name + suffix for suffix in _SUFFIXES[self.type]} | {s.name for s in self.samples}


def _unescape(value: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], value)


def _parse_value(token: str, lineno: int) -> float:
    try:
        return float(token)  # accepts NaN, +Inf, -Inf, exponents
    except ValueError:
        raise ExpositionError(f"line {lineno}: value {token!r} is not a number") from None


def _parse_sample(line: str, lineno: int) -> Sample:
    match = _NAME.match(line)
    if not match:
        raise ExpositionError(f"line {lineno}: no metric name at the start of {line[:80]!r}")
    name = match.group(0)
    pos = match.end()
    labels: list[tuple[str, str]] = []
    if pos < len(line) and line[pos] == "{":
        pos += 1
        while True:
            while pos < len(line) and line[pos] in " \t":
                pos += 1
            if pos < len(line) and line[pos] == "}":
                pos += 1
                break
            label = _LABEL.match(line, pos)
            if not label:
                raise ExpositionError(f"line {lineno}: malformed labels in {line[:80]!r}")
            labels.append((label.group(1), _unescape(label.group(2))))
            pos = label.end()
            if pos < len(line) and line[pos] == ",":
                pos += 1
            elif pos < len(line) and line[pos] == "}":
                pos += 1
                break
            else:
                raise ExpositionError(f"line {lineno}: expected ',' or '}}' in the labels of {line[:80]!r}")
    rest = line[pos:]
    if rest and rest[0] not in " \t":
        raise ExpositionError(f"line {lineno}: expected a space after {name!r}")
    tokens = rest.split()
    if len(tokens) not in (1, 2):
        raise ExpositionError(f"line {lineno}: expected 'value [timestamp]' after {name!r}, got {rest.strip()!r}")
    value = _parse_value(tokens[0], lineno)
    timestamp = None
    if len(tokens) == 2:
        try:
            timestamp = int(tokens[1])
        except ValueError:
            raise ExpositionError(f"line {lineno}: timestamp {tokens[1]!r} is not an integer") from None
    names = [k for k, _ in labels]
    if len(set(names)) != len(names):
        raise ExpositionError(f"line {lineno}: a label appears twice in {line[:80]!r}")
    return Sample(name, tuple(sorted(labels)), value, timestamp)


def parse_text(text: str) -> list[Family]:
    """Parse Prometheus text 0.0.4 into families, in order. Raises `ExpositionError` naming the bad line.

    Samples whose name does not belong to the family announced by the last `# TYPE`/`# HELP` line become untyped
    families of their own, as Prometheus itself reads them. Families are not merged here (see `merge`).
    """
    families: list[Family] = []
    current: Family | None = None
    by_name: dict[str, Family] = {}
    # Lines end at "\n" only (str.splitlines would also split inside label values at \u2028, \x1c, ...).
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip(" \t\r")
        if not line:
            continue
        if line.startswith("#"):
            meta = _META.match(line)
            if not meta:
                continue  # a plain comment
            parts = ["#", meta.group(1), meta.group(2)] + ([meta.group(3)] if meta.group(3) is not None else [])
            name = parts[2]
            if not _NAME.fullmatch(name):
                raise ExpositionError(f"line {lineno}: invalid metric name {name!r} in {parts[1]}")
            family = by_name.get(name)
            if family is not None and family is not current:
                raise ExpositionError(f"line {lineno}: second {parts[1]} block for {name!r}")
            if family is None:
                family = Family(name, "untyped")
                families.append(family)
                by_name[name] = family
            current = family
            if parts[1] == "HELP":
                family.help = _unescape(parts[3]) if len(parts) == 4 else ""
            else:
                kind = parts[3] if len(parts) == 4 else ""
                if kind not in TYPES:
                    raise ExpositionError(f"line {lineno}: unknown type {kind!r} for {name!r}")
                if family.samples:
                    raise ExpositionError(f"line {lineno}: TYPE for {name!r} after its samples")
                family.type = kind
            continue
        sample = _parse_sample(line, lineno)
        if current is not None and sample.name in {current.name + s for s in _SUFFIXES[current.type]}:
            current.samples.append(sample)
        else:
            current = Family(sample.name, "untyped", "", [sample])
            families.append(current)
            by_name[sample.name] = current
    return families


class TritonCounter(Metric):
    """A counter written as Triton writes it: the samples carry the family's name, with no `_total` suffix."""

    def __init__(self, name: str, documentation: str) -> None:
        super().__init__(name, documentation, "counter")


def from_client_metrics(metrics: Iterable[Metric]) -> list[Family]:
    """Convert prometheus_client `Metric`s (its OpenMetrics-style internal form) to the 0.0.4 view.

    As prometheus_client's own 0.0.4 writer does: counter `x` is written `x_total`, `info` `x` as gauge `x_info`,
    and `*_created` samples become a gauge family of their own.
    """
    families = []
    for metric in metrics:
        kind = {"unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}.get(
            metric.type, metric.type
        )
        name = metric.name
        if metric.type == "counter" and not isinstance(metric, TritonCounter):
            name = name + "_total"
        elif metric.type == "info":
            name = name + "_info"
        main: list[Sample] = []
        created: list[Sample] = []
        for s in metric.samples:
            sample = Sample(
                s.name,
                tuple(sorted(s.labels.items())),
                float(s.value),
                None if s.timestamp is None else int(float(s.timestamp) * 1000),
            )
            (created if s.name == metric.name + "_created" else main).append(sample)
        families.append(Family(name, kind, metric.documentation, main))
        if created:
            families.append(Family(metric.name + "_created", "gauge", metric.documentation, created))
    return families


def label_text(labels: Labels) -> str:
    if not labels:
        return ""
    body = ",".join(
        '{}="{}"'.format(k, v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')) for k, v in labels
    )
    return "{" + body + "}"


def value_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return floatToGoString(value)


def write_text(families: Iterable[Family]) -> bytes:
    """Prometheus text format 0.0.4."""
    out: list[str] = []
    for family in families:
        doc = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {family.name} {doc}\n")
        out.append(f"# TYPE {family.name} {family.type}\n")
        for s in family.samples:
            ts = "" if s.timestamp_ms is None else f" {s.timestamp_ms}"
            out.append(f"{s.name}{label_text(s.labels)} {value_text(s.value)}{ts}\n")
    return "".join(out).encode("utf-8")
