"""The experiment assignment (docs/clients.md, "Experiments"; llm_serving_client/assignment.py): uniform against
the declared allocation, sticky (the same in another process, and the same as the frozen vectors other languages
check against), and changing one arm's share moves units only into or out of that arm. No server: fast."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_serving.repository import REPO_ROOT
from llm_serving_client.assignment import assign, unit_draw


@dataclass(frozen=True)
class Arm:
    name: str
    percent: float


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2), in closed form
    for integer df (even: a Poisson sum; odd: erfc plus a half-integer sum)."""
    x = statistic / 2
    if df % 2 == 0:
        return math.exp(-x) * sum(x**i / math.factorial(i) for i in range(df // 2))
    total = math.erfc(math.sqrt(x))
    term = math.exp(-x) * math.sqrt(x) / math.gamma(1.5)
    for i in range(1, (df + 1) // 2):
        total += term
        term *= x / (i + 1.5)
    return total


def test_the_chi_square_helper_matches_known_quantiles():
    # chi-square critical values at p = 0.05 (df 1..4) and p = 0.001 (df 2), from the standard tables.
    for df, critical, p in ((1, 3.841, 0.05), (2, 5.991, 0.05), (3, 7.815, 0.05), (4, 9.488, 0.05),
                            (2, 13.816, 0.001)):
        assert chi_square_sf(critical, df) == pytest.approx(p, rel=2e-3)


@pytest.mark.parametrize("shares", [(90, 10), (50, 30, 20), (70, 10, 10, 5, 5), (99.5, 0.5)])
def test_arm_counts_over_100000_units_fit_the_declared_allocation(shares):
    arms = [Arm(f"arm{i}", p) for i, p in enumerate(shares)]
    n = 100_000
    counts = Counter(assign("chat-temperature", f"user-{u}", arms) for u in range(n))
    expected = {a.name: n * a.percent / 100 for a in arms}
    statistic = sum((counts[name] - e) ** 2 / e for name, e in expected.items())
    p_value = chi_square_sf(statistic, len(arms) - 1)
    assert p_value > 0.001, (counts, statistic, p_value)


def test_an_arm_without_a_share_gets_no_unit():
    arms = [Arm("control", 100), Arm("off", 0)]
    assert {assign("e", f"u{i}", arms) for i in range(2000)} == {"control"}


UNITS = [f"user-{i}" for i in range(5000)]
ARMS = [Arm("control", 50), Arm("cool", 30), Arm("warm", 20)]
SCRIPT = """
import json, sys
from llm_serving_client.assignment import assign
class Arm:
    def __init__(self, name, percent): self.name, self.percent = name, percent
arms = [Arm(n, p) for n, p in json.loads(sys.argv[1])]
units = json.loads(sys.stdin.read())
print(json.dumps([assign("chat-temperature", u, arms) for u in units]))
"""


def test_another_process_assigns_every_unit_the_same_arm():
    here = [assign("chat-temperature", u, ARMS) for u in UNITS]
    # Another interpreter with another hash seed: nothing process-local (Python's str hash) enters the assignment.
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([(a.name, a.percent) for a in ARMS])],
                         input=json.dumps(UNITS), capture_output=True, text=True, check=True, cwd=REPO_ROOT,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(out.stdout) == here


# Frozen: what any implementation of docs/clients.md, "Experiments" (any language, any release) must give. A change
# here is a change of every running experiment's cohorts.
FROZEN = {"user-0": "control", "user-1": "control", "user-2": "control", "user-3": "cool", "user-4": "control",
          "user-5": "control", "user-6": "warm", "user-7": "control"}


def test_the_assignment_is_the_documented_function():
    assert {u: assign("chat-temperature", u, ARMS) for u in FROZEN} == FROZEN
    # The draw is sha256("llm-serving-experiment\0" + experiment + "\0" + arm + "\0" + unit), first 8 bytes.
    import hashlib

    digest = hashlib.sha256(b"llm-serving-experiment\0chat-temperature\0cool\0user-3").digest()
    assert unit_draw("chat-temperature", "cool", "user-3") == (int.from_bytes(digest[:8], "big") + 0.5) / 2**64


weights = st.lists(st.integers(min_value=1, max_value=100), min_size=2, max_size=6)


@settings(max_examples=40, deadline=None)
@given(weights=weights, data=st.data())
def test_changing_one_arms_share_moves_units_only_into_or_out_of_that_arm(weights, data):
    """One arm's share changes, the others keep their proportions to each other (each arm's rate is its own):
    every unit that changes arm left that arm or joined it."""
    k = data.draw(st.integers(min_value=0, max_value=len(weights) - 1))
    new = data.draw(st.integers(min_value=0, max_value=100).filter(lambda w: w != weights[k]))
    before = [Arm(f"a{i}", w) for i, w in enumerate(weights)]
    after = [Arm(a.name, new if i == k else a.percent) for i, a in enumerate(before)]
    for u in range(1500):
        old_arm, new_arm = assign("exp", f"u{u}", before), assign("exp", f"u{u}", after)
        if old_arm != new_arm:
            assert f"a{k}" in (old_arm, new_arm), (u, old_arm, new_arm)
            # Growing, arm k only takes units; shrinking, it only gives them up.
            assert new_arm == f"a{k}" if new > weights[k] else old_arm == f"a{k}"


@settings(max_examples=30, deadline=None)
@given(weights=weights)
def test_adding_an_arm_takes_units_only_into_the_new_arm(weights):
    before = [Arm(f"a{i}", w) for i, w in enumerate(weights)]
    after = [*before, Arm("new", 10)]
    for u in range(1500):
        old_arm, new_arm = assign("exp", f"u{u}", before), assign("exp", f"u{u}", after)
        assert new_arm in (old_arm, "new")


def test_an_empty_unit_is_refused_by_name():
    with pytest.raises(ValueError, match="experiment 'e': the unit id is empty"):
        assign("e", "", ARMS)
