"""The model's own text handling: its tokenizer, the token budget and the prompt template (standard library only).

The tokenizer is the model's, not the LLM's: words, numbers and single punctuation marks, the units this model's
budget is written in. A ticket over the budget keeps its first tokens (the opening of a ticket states the problem)
and is marked as truncated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)

PROMPT_TEMPLATE = (
    "You triage support tickets. Answer with one JSON object: category, priority (1 = urgent .. 5 = later) and "
    "a short summary.\n"
    "Ticket: {ticket}\n"
    "JSON: "
)


def tokenize(text: str) -> list[tuple[int, int]]:
    """The (start, end) character span of each token."""
    return [match.span() for match in _TOKEN.finditer(text)]


@dataclass(frozen=True)
class Budgeted:
    text: str  # the ticket, cut after its first `budget` tokens when longer
    tokens: int  # tokens in the original ticket
    truncated: bool


def fit_to_budget(ticket: str, budget: int) -> Budgeted:
    spans = tokenize(ticket)
    if len(spans) <= budget:
        return Budgeted(ticket.strip(), len(spans), False)
    return Budgeted(ticket[: spans[budget - 1][1]].strip() + " ...", len(spans), True)


def render_prompt(ticket: str) -> str:
    return PROMPT_TEMPLATE.format(ticket=ticket)
