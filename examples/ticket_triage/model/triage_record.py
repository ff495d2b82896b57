"""The typed record the model returns, and the schema the LLM's output is constrained to (standard library only)."""

from __future__ import annotations

import json
from dataclasses import dataclass

CATEGORIES = ("billing", "outage", "access", "bug", "other")
SUMMARY_MAX = 40

# Sent to the LLM as `structured_outputs` (vLLM's StructuredOutputsParams json): the LLM can only produce JSON that
# parses into a Triage, even with random weights.
SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": list(CATEGORIES)},
        "priority": {"enum": [1, 2, 3, 4, 5]},
        "summary": {"type": "string", "maxLength": SUMMARY_MAX},
    },
    "required": ["category", "priority", "summary"],
    "additionalProperties": False,
}


class RecordError(ValueError):
    """The LLM's text is not a valid record."""


@dataclass(frozen=True)
class Triage:
    category: str
    priority: int
    summary: str

    @classmethod
    def parse(cls, text: str) -> Triage:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecordError(f"the LLM's answer is not JSON ({exc}): {text[:80]!r}") from None
        if not isinstance(data, dict):
            raise RecordError(f"the LLM's answer is not a JSON object: {text[:80]!r}")
        category, priority, summary = data.get("category"), data.get("priority"), data.get("summary")
        if category not in CATEGORIES:
            raise RecordError(f"category {category!r} is not one of {', '.join(CATEGORIES)}")
        if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= 5:
            raise RecordError(f"priority {priority!r} is not an integer in 1..5")
        if not isinstance(summary, str):
            raise RecordError(f"summary {summary!r} is not a string")
        return cls(category, priority, " ".join(summary.split())[:SUMMARY_MAX])
