"""`bench.openai_frontend` compares two servers whose speed drifts on a shared machine, so its ratios are fair only if
the two measurements of a load are close in time: both servers up at once, each load measured on one and then on
the other, each side first in every other round, and half of the rounds with each server started first. Fast: the
servers and vLLM's benchmark are replaced by fakes that record what was started and measured, in order."""

from __future__ import annotations

import contextlib

import pytest

import bench.openai_frontend as bench


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    events: list[tuple] = []

    @contextlib.contextmanager
    def both_servers(package, model_dir, workdir, order):
        events.append(("start", order))
        yield {name: bench.Side(pid=index, url=f"http://{name}") for index, name in enumerate(order)}
        events.append(("stop", order))

    def measured(pid, url, model_dir, label, load, extra=()):
        events.append(("measure", label, load.name))
        return {"label": label, "load": load.name, "at": len(events)}

    monkeypatch.setattr(bench, "both_servers", both_servers)
    monkeypatch.setattr(bench, "_measured", measured)
    monkeypatch.setattr(bench, "publish_demo", lambda model_dir, workdir, version: tmp_path / "package")
    monkeypatch.setattr(bench.time, "sleep", lambda seconds: events.append(("sleep", seconds)))
    return events


@pytest.mark.parametrize("rounds", [1, 3, 6])
def test_each_load_is_measured_on_both_servers_in_turn_with_the_first_side_alternating(recorded, tmp_path, rounds):
    results = bench.measure(tmp_path / "model", tmp_path, rounds=rounds)
    assert [len(results[name]) for name in bench.SERVERS] == [rounds, rounds]
    measures = [event for event in recorded if event[0] == "measure"]
    assert len(measures) == rounds * len(bench.LOADS) * 2
    pairs = [measures[i:i + 2] for i in range(0, len(measures), 2)]
    for index, pair in enumerate(pairs):
        number = index // len(bench.LOADS)  # the round this pair belongs to
        load = bench.LOADS[index % len(bench.LOADS)].name
        first = bench.SERVERS if number % 2 == 0 else bench.SERVERS[::-1]
        assert pair == [("measure", first[0], load), ("measure", first[1], load)]
    # every measurement waits out the other engine's busy-poll first
    assert all(recorded[recorded.index(m) - 1] == ("sleep", bench.ENGINE_SPIN_S) for m in measures)
    # each server's outcome of a round is its own, for every load
    for name in bench.SERVERS:
        for outcome in results[name]:
            assert {load.name: (o["label"], o["load"]) for load, o in zip(bench.LOADS, outcome.values(), strict=True)} \
                == {load.name: (name, load.name) for load in bench.LOADS}


def test_half_of_the_rounds_start_each_server_first_and_every_start_is_stopped(recorded, tmp_path):
    bench.measure(tmp_path / "model", tmp_path, rounds=5)
    starts = [event for event in recorded if event[0] in ("start", "stop")]
    assert starts == [("start", bench.SERVERS), ("stop", bench.SERVERS),
                      ("start", bench.SERVERS[::-1]), ("stop", bench.SERVERS[::-1])]
    stops = [i for i, event in enumerate(recorded) if event[0] == "stop"]
    # three rounds in the first block, two in the second
    assert sum(1 for event in recorded[:stops[0]] if event[0] == "measure") == 3 * len(bench.LOADS) * 2
    assert sum(1 for event in recorded[stops[0]:] if event[0] == "measure") == 2 * len(bench.LOADS) * 2


def test_one_round_starts_only_the_first_block(recorded, tmp_path):
    bench.measure(tmp_path / "model", tmp_path, rounds=1)
    assert [event for event in recorded if event[0] == "start"] == [("start", bench.SERVERS)]


def test_the_report_gives_each_rounds_ratio_of_every_target_beside_vllms_text_fields(monkeypatch, tmp_path):
    """A round's results hold vLLM's benchmark's own fields too, text among them (its backend, its label): the
    report's per-round ratios read only each target's metric (a division of every field crashed a whole run once)."""
    def round_of(scale: float) -> dict:
        values = {metric: 10.0 * scale for metric in (*bench.METRICS, *bench.CPU_METRICS)}
        return {load.name: {**values, "backend": "openai", "label": "x"} for load in bench.LOADS}

    results = {"llm-serving": [round_of(1.0), round_of(2.0)], "vllm": [round_of(1.0), round_of(4.0)]}
    monkeypatch.setattr(bench, "measure", lambda model_dir, workdir, rounds: results)
    monkeypatch.setattr(bench, "demo_model", lambda: tmp_path / "model")
    markdown = bench.run(tmp_path, rounds=2)["markdown"]
    assert "c32 request_throughput 1.00, 0.50" in markdown
    assert "c1 median_tpot_ms 1.00, 0.50" in markdown
