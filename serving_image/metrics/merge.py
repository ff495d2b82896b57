"""Merge families from several sources into one exposition: every family once, no duplicate series.

Sources are given in priority order (the proxy's own metrics, then vLLM's multiprocess files, then the upstream).
Rules, in order:
1. Families of the same name from the same source are one family (0.0.4 lets untyped samples repeat a name).
2. A series (sample name + labels) seen twice within a family keeps its first value; the repeat is counted.
3. A family whose name or any sample name is already taken (by a higher-priority source, or by an earlier family
   of the same source) is left out as a whole and counted as shadowed. Example: Triton's vLLM backend exports 8 `vllm:*`
   families itself; the same families from vLLM's own files are a superset of those series (every label vLLM
   sets), and adding both would double every sum() in the dashboards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving_image.metrics.exposition import Family


@dataclass
class MergeReport:
    families: list[Family]
    shadowed: list[tuple[str, str]] = field(default_factory=list)  # (source, family name) left out
    duplicate_series: int = 0


def _combine(families: list[Family]) -> tuple[list[Family], int]:
    """Rules 1 and 2 within one source."""
    by_name: dict[str, Family] = {}
    order: list[str] = []
    duplicates = 0
    for family in families:
        target = by_name.get(family.name)
        if target is None:
            target = Family(family.name, family.type, family.help, [])
            by_name[family.name] = target
            order.append(family.name)
        elif target.type == "untyped" and family.type != "untyped" and not target.samples:
            target.type = family.type
        if not target.help and family.help:
            target.help = family.help
        seen = {(s.name, s.labels) for s in target.samples}
        for sample in family.samples:
            key = (sample.name, sample.labels)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            target.samples.append(sample)
    return [by_name[name] for name in order], duplicates


def merge(sources: list[tuple[str, list[Family]]]) -> MergeReport:
    """Merge `(source name, families)` pairs, highest priority first."""
    taken: set[str] = set()
    report = MergeReport(families=[])
    for source, families in sources:
        combined, duplicates = _combine(families)
        report.duplicate_series += duplicates
        for family in combined:
            names = family.sample_names() | {family.name}
            if names & taken:  # taken by a higher-priority source, or by an earlier family of this one
                report.shadowed.append((source, family.name))
                continue
            taken |= names
            report.families.append(family)
    return report
