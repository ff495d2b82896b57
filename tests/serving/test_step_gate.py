"""The step gate's two halves without an engine: the plugin's wait for a grant (step_gate_plugin._take_grant, as
vLLM's engine core calls it before a step) against the test side's grants (StepGate)."""

from __future__ import annotations

import threading

import pytest

from tests.serving import step_gate_plugin
from tests.serving.step_gate import StepGate


def test_an_engine_takes_one_grant_a_step_waits_without_one_and_runs_freely_once_the_gate_opens(tmp_path):
    gate = tmp_path / "engine-7"
    step_gate_plugin._take_grant(gate)  # no gate: the step runs
    gate.mkdir()
    for name in ("grant-000001", "grant-000000"):
        (gate / name).touch()
    step_gate_plugin._take_grant(gate)
    assert [p.name for p in gate.iterdir()] == ["grant-000001"]  # the oldest grant first, one a step
    step_gate_plugin._take_grant(gate)
    waiting = threading.Thread(target=step_gate_plugin._take_grant, args=(gate,), daemon=True)
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive(), "a step ran without a grant"
    StepGate(tmp_path, stub_pid=7).open()
    waiting.join(5)
    assert not waiting.is_alive(), "the opened gate still held the step"


def test_a_grant_is_withdrawn_when_what_it_waited_for_happened_first(tmp_path):
    with StepGate.closed(tmp_path, stub_pid=8) as gate:  # no engine takes anything
        assert gate.step(unless=lambda: True) is False
        assert list(gate.directory.iterdir()) == []


def test_step_until_stops_granting_once_reached_and_bounds_the_steps(tmp_path):
    with StepGate.closed(tmp_path, stub_pid=9) as gate:
        taken: list[int] = []
        stop = threading.Event()

        def engine() -> None:  # counts a step before its grant goes, so a returned step() is already counted
            while not stop.is_set():
                for grant in sorted(gate.directory.iterdir()):
                    taken.append(1)
                    grant.unlink()

        runner = threading.Thread(target=engine, daemon=True)
        runner.start()
        assert gate.step_until(lambda: len(taken) >= 3, pause_s=0) == 3
        with pytest.raises(AssertionError, match="not reached after 5 engine steps"):
            gate.step_until(lambda: False, pause_s=0, limit=5)
        assert len(taken) == 8  # no step without a grant
        stop.set()
        runner.join(5)


def test_the_plugin_is_inert_without_its_environment(monkeypatch):
    monkeypatch.delenv(step_gate_plugin.GATE_ENV, raising=False)
    assert step_gate_plugin.register() is None  # returns before importing vLLM
