"""A guard around kafka-python 3's cross-thread calls, so a missed wake-up of its IO thread cannot hang a worker.

kafka-python 3 runs each client's network loop on an IO thread. A blocking call from another thread (`poll`,
`commit`, a metadata fetch) schedules a coroutine on that loop and waits for it with no time limit. When the
coroutine waits on a future that is then resolved on a thread other than the IO thread, the coroutine is queued
again without waking the loop; the loop stays asleep in `select` with nothing scheduled and the caller waits for
ever. `tests/unit/infra/test_kafka_io_loop.py` reproduces this with kafka-python's own classes; a test of ours once
hung for 300 s in `KafkaConsumer.poll(timeout_ms=200)` this way. kafka-python's maintainers bounded the wait after
3.0.12 (no release carries it yet).

`guard_cross_thread_calls` replaces `NetworkSelector.run` for calls from other threads: the call is scheduled the
same way, and the caller wakes the loop every `_NUDGE_S` while it waits. A missed wake-up therefore costs at most
`_NUDGE_S`. A call that still has not finished after `_GIVE_UP_S` (longer than any timeout our settings give
kafka-python) raises `KafkaTimeoutError` instead of hanging, and the worker fails with that reason.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kafka.errors import KafkaConnectionError, KafkaTimeoutError
from kafka.net.selector import NetworkSelector

_NUDGE_S = 0.5
_GIVE_UP_S = 900.0

_original_run = NetworkSelector.run


def _run_waking_the_loop(net: NetworkSelector, coro: Any, *args: Any) -> Any:
    io_thread = net._io_thread
    if io_thread is None or threading.current_thread() is io_thread:
        return _original_run(net, coro, *args)  # the loop runs on this thread: nothing to wake
    if net._closed:
        raise RuntimeError("NetworkSelector closed!")
    if net._exception:
        raise net._exception from None
    finished = threading.Event()
    future = net.call_soon_with_future(coro, *args)  # schedules on the loop and wakes it
    future.add_both(lambda _: finished.set())
    give_up_at = time.monotonic() + _GIVE_UP_S
    while not finished.wait(_NUDGE_S):
        if net._exception:
            raise net._exception from None
        if net._closed or net._io_thread is None:
            raise KafkaConnectionError("kafka-python's IO loop stopped while a call waited for it")
        if time.monotonic() > give_up_at:
            raise KafkaTimeoutError(f"kafka-python's IO loop did not finish {coro!r} in {_GIVE_UP_S:.0f} s")
        net.wakeup()
    if future.exception is not None:
        raise future.exception
    return future.value


def guard_cross_thread_calls() -> None:
    """Install the guard (idempotent). `infra.kafka` calls this on import, before any client exists."""
    NetworkSelector.run = _run_waking_the_loop
