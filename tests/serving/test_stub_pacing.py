"""The stand-in vllm backend's pacing of streamed responses (model.py `SendPacer`): under load a request's deltas
are merged into fewer responses, never losing or reordering text, tokens or log-probabilities; the first and the
final response are never held; with little in flight every engine step is a response. Fast: the model is loaded
with a stand-in for triton_python_backend_utils (tests/serving/conftest.py `stub_models`) and a clock the test
moves (each send takes SEND_COST_S of it, each engine step `step_s`)."""

from __future__ import annotations

import json
import threading
import types

SEND_COST_S = 0.001


class _Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class _Sender:
    """Keeps every response with the clock's time and flags; a send takes SEND_COST_S."""

    def __init__(self, clock: _Clock):
        self.clock, self.sent = clock, []

    def send(self, response, flags=0):
        self.sent.append((self.clock.now, response, flags))
        self.clock.now += SEND_COST_S


def _stream(generation, monkeypatch, in_flight: int, steps: int, step_s: float) -> tuple[_Sender, list[str]]:
    """One streamed request (of `in_flight`) that gets `steps` one-token deltas, `step_s` apart; the last is final."""
    clock = _Clock()
    monkeypatch.setattr(generation, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    model = generation.TritonPythonModel.__new__(generation.TritonPythonModel)
    model._lock, model._pacer = threading.Lock(), generation.SendPacer()
    sender = _Sender(clock)
    flags = dict.fromkeys(generation.RETURN_FLAGS, True)
    parsed = {"stream": True, "prepend": False, "prompt": "p", "flags": flags}
    model._requests = {f"other-{i}": generation._Request(_Sender(clock), parsed) for i in range(in_flight - 1)}
    model._requests["r"] = generation._Request(sender, parsed)
    words = [""] + [f"w{i} " for i in range(1, steps)]  # the first token's delta without text (see SendPacer)
    for i, word in enumerate(words):
        done = i == steps - 1
        model._answer({"id": "r", "p": 3, "done": done,
                       "out": [[0, word, 1, "length" if done else None, [{str(i): {"logprob": -0.5}}]]]})
        clock.now += step_s
    return sender, words


def _outputs(sender: _Sender, name: str) -> list:
    return [response.outputs[name][0] for _, response, _ in sender.sent]


def test_under_load_deltas_merge_into_fewer_responses_and_nothing_is_lost(stub_models, monkeypatch):
    generation, _ = stub_models
    in_flight, steps, step_s = 16, 200, 0.005
    sender, words = _stream(generation, monkeypatch, in_flight, steps, step_s)
    interval = in_flight * SEND_COST_S / generation.SendPacer.SEND_SHARE  # 160 ms at a share of 0.1: 32 steps
    assert 2 < len(sender.sent) < steps / 5
    assert b"".join(_outputs(sender, "text_output")).decode() == "".join(words)
    assert sum(int(n) for n in _outputs(sender, "num_output_tokens")) == steps
    positions = [position for text in _outputs(sender, "logprobs") for position in json.loads(text)]
    assert positions == [{str(i): {"logprob": -0.5}} for i in range(steps)]
    times = [at for at, _, _ in sender.sent]
    # the first delta (no text) and the first with text went out at once, one step apart
    assert times[:2] == [100.0, 100.0 + SEND_COST_S + step_s] and _outputs(sender, "text_output")[:2] == [b"", b"w1 "]
    hold = generation.SendPacer.HOLD_SHARE * interval
    assert all(b - a >= hold for a, b in zip(times[1:-2], times[2:-1], strict=True)), times
    assert [flag for _, _, flag in sender.sent] == [0] * (len(sender.sent) - 1) + [1]
    assert _outputs(sender, "finish_reason")[-1] == b"length"


def test_with_little_in_flight_every_step_is_a_response(stub_models, monkeypatch):
    generation, _ = stub_models
    interval = SEND_COST_S / generation.SendPacer.SEND_SHARE  # one in flight
    sender, words = _stream(generation, monkeypatch, 1, 20, step_s=1.5 * interval)
    assert [text.decode() for text in _outputs(sender, "text_output")] == words
    assert [int(n) for n in _outputs(sender, "num_output_tokens")] == [1] * 20


def test_vllm_merges_a_share_of_the_interval_for_a_streamed_request_admitted_under_load(stub_models, monkeypatch):
    generation, _ = stub_models
    pacer = generation.SendPacer()
    assert pacer.stream_interval(32) == 1  # nothing measured yet: every step
    pacer.sent(0.0002)
    for _ in range(3):
        pacer.streamed(20, 0.1)  # 200 tokens a second per request
    # 32 in flight with this one: a response every 32 x 0.2 ms / 0.1 = 64 ms, 12.8 tokens, which vLLM merges
    assert pacer.stream_interval(32) == 13
    assert pacer.stream_interval(1) == 1  # alone: every step
    pacer.streamed(0, 0.1)  # a response without tokens (text held back by the detokenizer) says nothing of the pace
    assert pacer.stream_interval(32) == 13


def test_the_interval_travels_with_the_request_and_a_non_streamed_one_gets_first_and_last(stub_models, monkeypatch):
    generation, _ = stub_models
    model = generation.TritonPythonModel.__new__(generation.TritonPythonModel)
    model._lock, model._pacer, model._requests, model._dead = threading.Lock(), generation.SendPacer(), {}, None
    model.tasks, model.model_name = ("generate",), "m"
    model._pacer.sent(0.0002)
    model._pacer.streamed(20, 0.1)  # 200 tokens a second per request
    sent = []
    model._send = sent.append
    for stream in (True, False):
        parsed = {"stream": stream, "prepend": not stream, "prompt": "p", "params": None, "root": "sampling_parameters",
                  "flags": dict.fromkeys(generation.RETURN_FLAGS, False)}
        monkeypatch.setattr(generation, "read_request", lambda request, inputs, name, parsed=parsed: parsed)
        model._requests.update({f"other-{i}": object() for i in range(31 - len(model._requests))})
        model.execute([types.SimpleNamespace(get_response_sender=lambda: None, request_id=lambda: "c",
                                             inputs=lambda: [])])
    assert [m["interval"] for m in sent] == [13, generation.NOT_STREAMED_INTERVAL]  # 32 in flight, as above
