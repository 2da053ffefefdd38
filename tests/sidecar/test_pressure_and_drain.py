"""The sidecar's pressure gauge and its drain, on their own (no model)."""

from __future__ import annotations

import asyncio

import pytest

from kvshard_sidecar.api.drain import Drain
from kvshard_sidecar.pressure import PressureTracker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pressure_is_the_larger_of_queue_and_latency() -> None:
    clock = Clock()
    tracker = PressureTracker(2, 1.0, 10.0, clock=clock)
    for _ in range(3):
        tracker.arrived()
    tracker.started()
    reading = tracker.read()
    assert (reading.waiting, reading.inflight, reading.queue) == (2, 1, 1.5)
    assert reading.pressure == 1.5
    for seconds in [0.5] * 9 + [4.0]:
        tracker.observe_ttft(seconds)
    assert tracker.read().ttft_p90_seconds == 0.5  # nearest rank: the 9th of 10
    tracker.observe_ttft(4.0)
    assert tracker.read().ttft_p90_seconds == 4.0
    assert tracker.read().pressure == 4.0
    tracker.left(started=True)
    tracker.left(started=False)
    tracker.left(started=False)
    clock.now = 11.0  # every TTFT left the window
    reading = tracker.read()
    assert (reading.waiting, reading.inflight, reading.pressure) == (0, 0, 0.0)


def test_when_vllm_computes_its_queue_is_the_pods_queue() -> None:
    """The sidecar admits many recommendations at once and vLLM schedules their candidates: a full vLLM
    is pressure even while the sidecar's own admission is far from full."""
    tracker = PressureTracker(8, 1.0, 10.0, clock=Clock())
    tracker.arrived()
    tracker.started()
    assert tracker.read().queue == 1 / 8
    tracker.engine_queue(running=64, waiting=32, capacity=64)  # vLLM's batch full, half a batch waiting
    assert tracker.read().queue == tracker.read().pressure == 1.5
    tracker.engine_queue(running=0, waiting=0, capacity=64)
    assert tracker.read().queue == 1 / 8  # the sidecar's own term still counts


def test_ttft_window_memory_is_bounded() -> None:
    tracker = PressureTracker(1, 1.0, 1e9, max_samples=16)
    for i in range(1000):
        tracker.observe_ttft(float(i))
    assert tracker.read().ttft_p90_seconds >= 984.0


async def test_drain_withdraws_once_and_waits_for_the_requests_inside() -> None:
    inside = [2]
    withdrawn: list[int] = []
    drain = Drain(lambda: inside[0], settle_seconds=0.1)

    async def withdraw() -> None:
        withdrawn.append(1)

    async def finish_later() -> None:
        await asyncio.sleep(0.2)
        drain.arrived()  # a request the router chose before it saw the withdrawal
        inside[0] = 0

    task = asyncio.create_task(finish_later())
    answer = await drain.run(withdraw, timeout=5.0, poll=0.01)
    await task
    assert answer["drained"] and answer["served_while_draining"] == 1 and answer["seconds"] >= 0.3
    assert drain.draining and withdrawn == [1]
    again = await drain.run(withdraw, timeout=1.0, poll=0.01)
    assert again["drained"] and withdrawn == [1]


async def test_drain_times_out_while_a_request_is_stuck() -> None:
    drain = Drain(lambda: 1, settle_seconds=0.0)

    async def withdraw() -> None:
        return None

    answer = await drain.run(withdraw, timeout=0.1, poll=0.01)
    assert not answer["drained"] and answer["inside"] == 1


def test_bad_pressure_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        PressureTracker(0, 1.0, 1.0)
