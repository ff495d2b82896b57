"""vLLM's per-step stat logging runs after the step's outputs reached their requests
(serving_image/engine/async_llm_model.py `stat_logging_after_delivery`): every step recorded, in order, with its own
values, once the loop has run what the outputs woke; a failing record is logged, not raised into vLLM's output
handler. A stand-in manager records the calls (the real one writes prometheus_client files: the served suites check
vLLM's families through the metrics proxy)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from serving_image.engine.async_llm_model import stat_logging_after_delivery


class Manager:
    def __init__(self, fail_on: int | None = None):
        self.calls: list[dict] = []
        self.fail_on = fail_on

    def record(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if kwargs.get("engine_idx") == self.fail_on:
            raise RuntimeError("a metric could not be written")


def test_each_step_is_recorded_after_what_its_outputs_woke_and_in_order():
    manager = Manager()
    llm = SimpleNamespace(logger_manager=manager)
    stat_logging_after_delivery(llm)
    order: list[str] = []

    async def output_handler_step(step: int, delivered: asyncio.Event) -> None:
        # as vLLM's output handler: outputs pushed to the requests' queues (waking their consumers), then the
        # step's record, with no await between them
        delivered.set()
        llm.logger_manager.record(engine_idx=step, scheduler_stats=f"s{step}", iteration_stats=f"i{step}")
        order.append(f"recorded-call {step}")

    async def consumer(step: int, delivered: asyncio.Event) -> None:
        await delivered.wait()
        order.append(f"delivered {step}")

    async def main() -> None:
        for step in range(3):
            delivered = asyncio.Event()
            waiting = asyncio.create_task(consumer(step, delivered))
            await asyncio.sleep(0)  # the consumer waits on its queue
            await output_handler_step(step, delivered)
            assert manager.calls[step:] == []  # not yet: the consumer runs first
            await waiting
            await asyncio.sleep(0)
            assert manager.calls[step] == {"engine_idx": step, "scheduler_stats": f"s{step}",
                                           "iteration_stats": f"i{step}"}

    asyncio.run(main())
    assert [c["engine_idx"] for c in manager.calls] == [0, 1, 2]
    assert order == [x for step in range(3) for x in (f"recorded-call {step}", f"delivered {step}")]


def test_a_failing_record_is_logged_and_the_next_steps_are_still_recorded(caplog):
    manager = Manager(fail_on=1)
    llm = SimpleNamespace(logger_manager=manager)
    stat_logging_after_delivery(llm)

    async def main() -> None:
        for step in range(3):
            llm.logger_manager.record(engine_idx=step)  # never raises into the caller (vLLM's output handler)
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="serving_image.engine.async_llm_model"):
        asyncio.run(main())
    assert [c["engine_idx"] for c in manager.calls] == [0, 1, 2]
    assert "vLLM's stat logging failed for one engine step" in caplog.text
    assert "a metric could not be written" in caplog.text


@pytest.mark.parametrize("llm", [SimpleNamespace(logger_manager=None), SimpleNamespace()])
def test_an_engine_without_stats_is_left_alone(llm):
    stat_logging_after_delivery(llm)
    assert getattr(llm, "logger_manager", None) is None
