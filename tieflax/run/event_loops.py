"""The event loops orbax runs its synchronous calls on (restore, metadata, a save's commit), closed cleanly.

orbax runs each such call on a fresh event loop (``asyncio_utils._run_sync_via_new_loop``) and closes it
as soon as the call returns. TensorStore ends every read or write by calling back into the loop that
awaits it, from its own threads. When one operation fails (a damaged array file, a full disk), the call
returns at once with that error while the others are still in flight; each of them, ending later, called
back into the closed loop: ``RuntimeError: Event loop is closed``, printed as an unraisable exception
seconds after the one line that had already said what failed, and its awaiting task was destroyed pending.

``install()`` gives orbax a loop that ends as ``asyncio.run`` ends one: the tasks still pending when the
call returns are cancelled and awaited (within the storage deadline, so a silent bucket cannot hold a
process), then the loop closes; a TensorStore callback that arrives after that, for an operation whose
task has ended, is dropped. Nothing waits for it: its result belonged to the failed call.
"""

from __future__ import annotations

import asyncio

from tieflax import storage


class _LoopThatDropsLateCallbacks(asyncio.SelectorEventLoop):
    """An event loop that, once closed, ignores a callback scheduled from another thread."""

    def call_soon_threadsafe(self, callback, *args, context=None):
        if self.is_closed():
            return None  # an operation that ended after its call did: nobody awaits it any more
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():  # closed between the check and the call
                return None
            raise


def run_sync_then_close(coro):
    """Runs ``coro`` to its end on a fresh loop; cancels and awaits what it left pending; closes the loop.

    The replacement of orbax's ``_run_sync_via_new_loop`` (same contract: the coroutine's result, or its
    exception, raised here)."""
    loop = _LoopThatDropsLateCallbacks()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:  # their errors are the one already raised, or its twins: retrieved, not reported
                loop.run_until_complete(asyncio.wait_for(asyncio.gather(*left, return_exceptions=True),
                                                         _deadline_seconds()))
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass  # a task that ignores its cancellation past the deadline: left to the closed loop
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _deadline_seconds() -> float:
    """The storage deadline; its default where the setting is malformed (that is reported by the storage
    call that reads it: here it must not replace the error being raised)."""
    try:
        return storage.deadline_seconds()
    except storage.StorageError:
        return storage.DEFAULT_DEADLINE_S


def install() -> None:
    """Makes orbax run its synchronous calls through :func:`run_sync_then_close` (idempotent). An orbax
    without ``asyncio_utils._run_sync_via_new_loop`` keeps its own way."""
    from orbax.checkpoint._src import asyncio_utils  # noqa: PLC0415

    if getattr(asyncio_utils, "_run_sync_via_new_loop", None) not in (None, run_sync_then_close):
        asyncio_utils._run_sync_via_new_loop = run_sync_then_close
