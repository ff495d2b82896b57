"""OpenMetrics 1.0 writer for the 0.0.4 model of `exposition.py`.

A counter whose samples end in `_total` becomes family `x` with samples `x_total`; a counter whose samples do not
(Triton's) is written as `unknown`, the only OpenMetrics type that keeps its series name unchanged. OpenMetrics
checks more than 0.0.4 does (non-negative integral counts, ordered buckets, reserved suffixes), and a Prometheus
that rejects one family rejects the whole scrape, so whatever it could not accept typed is written as `unknown`
series by series: every series still arrives under its own name and labels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.utils import floatToGoString

from serving_image.metrics.exposition import Family, Labels, Sample, label_text, value_text


def _canonical(number: str) -> bool:
    try:
        return floatToGoString(float(number)) == number
    except ValueError:
        return False


def _counter_like_ok(value: float) -> bool:
    return not math.isnan(value) and value >= 0


def _grouped(family: Family, key: str) -> dict[Labels, list[Sample]] | None:
    """Samples by label set without `key` (le / quantile); None if a sample lacks a valid `key`."""
    groups: dict[Labels, list[Sample]] = {}
    for sample in family.samples:
        labels = dict(sample.labels)
        if sample.name == family.name + ("_bucket" if key == "le" else ""):
            if key not in labels or not _canonical(labels[key]):
                return None
            del labels[key]
        groups.setdefault(tuple(sorted(labels.items())), []).append(sample)
    return groups


def _openmetrics_histogram(family: Family) -> list[Sample] | None:
    """The samples in the order OpenMetrics requires, or None when they break its rules (checked as the reference
    parser checks them: +Inf bucket, ordered integral buckets, _count equal to +Inf, _sum and _count together)."""
    groups = _grouped(family, "le")
    if groups is None:
        return None
    ordered: list[Sample] = []
    for samples in groups.values():
        buckets = sorted((s for s in samples if s.name == family.name + "_bucket"),
                         key=lambda s: float(dict(s.labels)["le"]))
        counts = [s for s in samples if s.name == family.name + "_count"]
        sums = [s for s in samples if s.name == family.name + "_sum"]
        if not buckets or dict(buckets[-1].labels)["le"] != "+Inf" or len(counts) > 1 or len(sums) > 1:
            return None
        if bool(counts) != bool(sums) or any(s.timestamp_ms is not None for s in samples):
            return None
        values = [b.value for b in buckets]
        if not all(_counter_like_ok(v) and float(v).is_integer() for v in values):
            return None
        if values != sorted(values) or len({dict(b.labels)["le"] for b in buckets}) != len(buckets):
            return None
        if counts and (counts[0].value != values[-1]):
            return None
        # A histogram's _sum is counter-like in OpenMetrics: never NaN, never negative (a negative observation makes
        # it negative, and then the histogram may carry no sum at all), and absent when a bucket bound is negative.
        if sums and (not _counter_like_ok(sums[0].value) or any(float(dict(b.labels)["le"]) < 0 for b in buckets)):
            return None
        ordered += buckets + counts + sums
    return ordered


def _openmetrics_summary(family: Family) -> list[Sample] | None:
    groups = _grouped(family, "quantile")
    if groups is None:
        return None
    ordered: list[Sample] = []
    for samples in groups.values():
        quantiles = [s for s in samples if s.name == family.name]
        counts = [s for s in samples if s.name == family.name + "_count"]
        sums = [s for s in samples if s.name == family.name + "_sum"]
        if len(counts) > 1 or len(sums) > 1 or any(s.timestamp_ms is not None for s in samples):
            return None
        if not all(0 <= float(dict(q.labels)["quantile"]) <= 1 and not q.value < 0 for q in quantiles):
            return None
        if not all(_counter_like_ok(c.value) and float(c.value).is_integer() for c in counts):
            return None
        if not all(_counter_like_ok(x.value) for x in sums):
            return None
        ordered += quantiles + counts + sums
    return ordered


_OM_SUFFIXES = {
    "counter": ("", "_total", "_created"),
    "gauge": ("",),
    "unknown": ("",),
    "histogram": ("", "_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}

_Plan = list[tuple[str, str, list[Sample]]]


def _as_unknown(family: Family) -> _Plan:
    """One `unknown` family per sample name: every series kept exactly as it is, without a type."""
    by_name: dict[str, list[Sample]] = {}
    for sample in family.samples:
        by_name.setdefault(sample.name, []).append(sample)
    return [(name, "unknown", samples) for name, samples in by_name.items()] or [(family.name, "unknown", [])]


def _openmetrics_plan(family: Family) -> _Plan:
    """(name, type, samples) in OpenMetrics for one 0.0.4 family, before name clashes are considered.

    What OpenMetrics cannot type the way 0.0.4 did is written as `unknown` (OpenMetrics checks more than 0.0.4:
    non-negative integral counts, ordered buckets...; and a Prometheus that rejects one family rejects the scrape).
    """
    kind = family.type
    if kind == "counter":
        if family.name.endswith("_total") and all(
            s.name == family.name and _counter_like_ok(s.value) for s in family.samples
        ):
            return [(family.name[: -len("_total")], "counter", family.samples)]
        return _as_unknown(family)  # Triton's counters (no `_total`), or negative values
    if kind in ("histogram", "summary"):
        ordered = (_openmetrics_histogram if kind == "histogram" else _openmetrics_summary)(family)
        return [(family.name, kind, ordered)] if ordered is not None else _as_unknown(family)
    return [(family.name, "unknown" if kind == "untyped" else kind, family.samples)]


def _resolve_clashes(families: list[Family], plans: list[_Plan]) -> list[_Plan]:
    """A typed OpenMetrics family reserves its suffixed names too (counter `x`: `x_total`, `x_created`); where
    that clashes with another family (0.0.4 allows gauge `x_created` beside counter `x_total`), the typed one is
    written as `unknown` instead."""
    changed = True
    while changed:
        changed = False
        owners: dict[str, int] = {}
        for plan in plans:
            for name, kind, _ in plan:
                for reserved in {name + suffix for suffix in _OM_SUFFIXES[kind]}:
                    owners[reserved] = owners.get(reserved, 0) + 1
        for i, plan in enumerate(plans):
            if any(
                len(_OM_SUFFIXES[kind]) > 1 and any(owners[name + suffix] > 1 for suffix in _OM_SUFFIXES[kind])
                for name, kind, _ in plan
            ):
                plans[i] = _as_unknown(families[i])
                changed = True
    return plans


def write_openmetrics(families: Iterable[Family]) -> bytes:
    """OpenMetrics 1.0 text (timestamps in seconds, `# EOF` at the end)."""
    families = list(families)
    plans = _resolve_clashes(families, [_openmetrics_plan(f) for f in families])
    out: list[str] = []
    for family, plan in zip(families, plans, strict=True):
        doc = family.help.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        for name, kind, samples in plan:
            out.append(f"# HELP {name} {doc}\n")
            out.append(f"# TYPE {name} {kind}\n")
            for s in samples:
                ts = "" if s.timestamp_ms is None else f" {floatToGoString(s.timestamp_ms / 1000.0)}"
                out.append(f"{s.name}{label_text(s.labels)} {value_text(s.value)}{ts}\n")
    out.append("# EOF\n")
    return "".join(out).encode("utf-8")
