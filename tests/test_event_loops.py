"""The event loops orbax's synchronous calls run on (tieflax/run/event_loops.py): when the call fails while
other operations are still in flight, those operations' completions, arriving later from other threads as
TensorStore's do, are taken silently and their tasks end cancelled, instead of "Event loop is closed"
(unraisable) and "Task was destroyed but it is pending"."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import pytest

from tieflax.run import event_loops


class _Reads:
    """Reads completed by threads of their own (as TensorStore completes them), once ``release`` is set."""

    def __init__(self):
        self.release, self.threads, self.completions = threading.Event(), [], []

    def arrived(self) -> list:
        self.release.set()
        for t in self.threads:
            t.join(timeout=120)  # a bound on a hang only: each thread ends as soon as it is released
        return self.completions


def _call_that_fails_with_a_read_in_flight(reads: _Reads) -> object:
    """A coroutine as orbax's restore is one: two reads started, the first fails, the call ends; the reads'
    completions are scheduled by other threads after that, into the call's loop."""
    completions = reads.completions

    async def read(fail: bool):
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def complete_later():
            reads.release.wait()
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(b"bytes"))
                completions.append("taken")
            except RuntimeError as e:  # what TensorStore's thread met: printed as unraisable
                completions.append(str(e))

        reads.threads.append(threading.Thread(target=complete_later, daemon=True))
        reads.threads[-1].start()
        if fail:
            raise OSError("a damaged array file")
        return await done

    async def restore():
        first = asyncio.ensure_future(read(fail=True))
        second = asyncio.ensure_future(read(fail=False))
        await first  # raises: the call ends here, the second read still in flight
        await second

    return restore()


def _destroyed_pending_tasks(caplog) -> list[str]:
    gc.collect()
    return [r.getMessage() for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


def test_a_failed_call_takes_its_late_completions_and_cancels_its_pending_tasks(caplog):
    reads = _Reads()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(OSError, match="damaged array file"):
            event_loops.run_sync_then_close(_call_that_fails_with_a_read_in_flight(reads))
        assert reads.arrived() == ["taken", "taken"]
        assert _destroyed_pending_tasks(caplog) == []


def test_a_plain_fresh_loop_meets_the_closed_loop_that_run_sync_then_close_prevents(caplog):
    """The failure modes themselves, on the loop orbax makes (a fresh loop closed as the call returns): the
    late completion raises 'Event loop is closed' in the completing thread, and the read still pending is
    destroyed pending."""

    def run_on_a_plain_loop(coro):
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()

    reads = _Reads()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(OSError):
            run_on_a_plain_loop(_call_that_fails_with_a_read_in_flight(reads))
        assert "Event loop is closed" in reads.arrived()
        assert _destroyed_pending_tasks(caplog)  # collected here, so that it is not printed later


def test_a_call_that_succeeds_returns_its_value_and_orbax_uses_the_loop():
    async def value():
        await asyncio.sleep(0)
        return 42

    assert event_loops.run_sync_then_close(value()) == 42
    event_loops.install()
    from orbax.checkpoint._src import asyncio_utils

    assert asyncio_utils._run_sync_via_new_loop is event_loops.run_sync_then_close
    assert asyncio_utils.run_sync(value()) == 42
