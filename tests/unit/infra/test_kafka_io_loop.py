"""The guard around kafka-python 3's cross-thread calls (infra/kafka_io_loop.py), against kafka-python's own loop."""

from __future__ import annotations

import threading
import time

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.future import Future
from kafka.net.selector import NetworkSelector

import infra.kafka  # noqa: F401  (installs the guard, as every client factory does)
from infra import kafka_io_loop


def _resolved_off_the_loop(run, value: object) -> tuple[bool, object]:
    """A coroutine on the IO thread awaits a future another thread resolves while the loop sleeps: (finished, value)."""
    net = NetworkSelector(client_id="io-loop-test")
    future = Future()
    asleep = threading.Event()
    select = net._selector.select

    def select_noting_the_sleep(timeout=None):
        # Reached only after the loop checked its ready queue: once the coroutine has hooked itself onto the future,
        # the loop goes to sleep here with nothing scheduled. Resolving the future from now on is the missed wake-up;
        # a fixed delay instead let a loaded machine run the check after the resolution, and the loop then finished.
        # Only a select that blocks counts: one with timeout 0 (more tasks were ready) runs the callback straight after.
        if future._callbacks and (timeout is None or timeout > 1.0):
            asleep.set()
        return select(timeout)

    net._selector.select = select_noting_the_sleep
    net.start()

    async def waits():
        return await future

    def resolve_once_asleep() -> None:
        asleep.wait(30.0)
        future.success(value)

    got: list[object] = []
    threading.Thread(target=resolve_once_asleep, daemon=True).start()
    caller = threading.Thread(target=lambda: got.append(run(net, waits)), daemon=True)
    caller.start()
    caller.join(3.0)
    finished = not caller.is_alive()  # read before the wake-up below, which lets a stuck caller finish after all
    net._stop = True  # the unguarded caller is stuck for good; let the IO thread end with the test
    net.wakeup()
    return (finished, got[0] if got else None)


def test_kafka_pythons_own_run_misses_a_wake_up_from_another_thread():
    # The defect the guard exists for: if this starts passing, kafka-python fixed it and the guard can go.
    finished, _ = _resolved_off_the_loop(kafka_io_loop._original_run, 7)
    assert not finished


def test_the_guard_wakes_the_loop_and_returns_the_value():
    assert NetworkSelector.run is kafka_io_loop._run_waking_the_loop
    started = time.monotonic()
    assert _resolved_off_the_loop(NetworkSelector.run, 7) == (True, 7)
    assert time.monotonic() - started < 0.2 + 2 * kafka_io_loop._NUDGE_S + 0.5


def test_the_guard_raises_the_coroutines_error_and_gives_up_on_a_loop_that_never_finishes(monkeypatch):
    net = NetworkSelector(client_id="io-loop-test")
    net.start()
    try:
        async def fails():
            raise ValueError("broken coroutine")

        with pytest.raises(ValueError, match="broken coroutine"):
            net.run(fails)

        monkeypatch.setattr(kafka_io_loop, "_GIVE_UP_S", 0.6)
        never = Future()

        async def waits_for_ever():
            return await never

        with pytest.raises(KafkaTimeoutError, match="did not finish"):
            net.run(waits_for_ever)
    finally:
        net.close()
