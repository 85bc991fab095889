"""The orbax item handlers of a run's checkpoints: ``state`` (the train state, orbax's PyTree handler)
and ``data`` (the grain iterator's position, written in the background commit and moved to another
number of processes on restore), registered with each manager (``handlers``); and how much of the
pending save this process has written (``OWN_SHARE``), which a save that outlives its deadline names.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jax
import orbax.checkpoint as ocp

from tieflax.run import event_loops
from tieflax.run.checkpoint_errors import ProcessCountError

_DATA_HANDLER_CLASS = None


def _data_iterator_handler():
    """grain's checkpoint handler (same files, same restore), with the file written in the background
    commit, as the arrays are, instead of in the blocking part of the save.

    Why: a blocking write that fails on one process makes that process leave ``manager.save`` early
    while the others go on to orbax's next barrier inside it, so one save failing on one host would
    stop every host at a barrier. Failing in the commit, it is seen by every process at the same step
    (``SaveWatch.failure``, agreed through ``distributed.first_failure``)."""
    global _DATA_HANDLER_CLASS
    if _DATA_HANDLER_CLASS is None:
        _DATA_HANDLER_CLASS = _define_data_iterator_handler()
    return _DATA_HANDLER_CLASS()


def _define_data_iterator_handler() -> type:
    import grain  # noqa: PLC0415
    from grain.python import DatasetIterator  # noqa: PLC0415
    from orbax.checkpoint import future  # noqa: PLC0415

    class DataIteratorHandler(grain.checkpoint.CheckpointHandler, ocp.AsyncCheckpointHandler):
        async def async_save(self, directory, item=None, args=None):
            item = item or args.item
            # The state is taken now: the iterator moves on as soon as the blocking part returns.
            state = (json.dumps(item.get_state(), indent=4) if isinstance(item, DatasetIterator)
                     else item.get_state().decode())
            path = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

            async def write() -> None:
                path.write_text(state)

            return OWN_SHARE.counted([future.CommitFutureAwaitingContractedSignals(write(), name="data_iterator_save")])

        def save(self, directory, item=None, args=None):
            for f in asyncio.run(self.async_save(directory, item=item, args=args)):
                f.result()

        def restore(self, directory, item=None, args=None):
            """grain's restore; a state saved by another number of processes is moved onto this run's
            (``_state_of_other_process_count``)."""
            item = item or args.item
            mine = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
            if mine.exists():
                return super().restore(directory, item=item, args=args)
            item.set_state(_state_of_other_process_count(directory, item, mine))
            item.start_prefetch()
            return item

    # grain's save/restore arguments now name this handler (a subclass of grain's: the same files)
    ocp.args.register_with_handler(DataIteratorHandler, for_save=True)(grain.checkpoint.CheckpointSave)
    ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)(grain.checkpoint.CheckpointRestore)
    return DataIteratorHandler


_PROCESS_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def _state_of_other_process_count(directory, item, mine) -> dict:
    """The data iterator state for this run's processes from the files of a checkpoint saved by another
    number of processes (``directory``: its ``data`` folder). ``make_loader``'s state is a function of
    the global step (``tieflax.data.loader.state_for_processes``): the new processes read exactly the
    batches an uninterrupted run would. Raises ProcessCountError when the saved state cannot be moved
    (same number of processes needed), ValueError when the folder is damaged (files missing)."""
    from tieflax.data.loader import state_for_processes  # noqa: PLC0415

    found = {}
    for f in directory.iterdir():
        m = _PROCESS_FILE.fullmatch(f.name)
        if m:
            found[int(m.group(1)), int(m.group(2))] = f
    counts = {n for _, n in found}
    if len(counts) != 1:
        raise ValueError(f"File {mine} does not exist" + (f" (the folder holds files of {sorted(counts)} "
                                                          "processes)" if counts else ""))
    (saved,) = counts
    missing = [i for i in range(saved) if (i, saved) not in found]
    if missing:
        raise ValueError(f"{directory} lacks the data position of process {missing[0]} of {saved}")
    states = []
    for i in range(saved):
        try:
            states.append(json.loads(found[i, saved].read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{found[i, saved]} is not JSON: {e}") from e
    state = state_for_processes(item, states)
    if state is None:
        step = directory.parent.name
        raise ProcessCountError(
            f"checkpoint {step} was saved by {saved} processes and this run has {jax.process_count()}, "
            f"and its data iterator's position cannot be moved to another number of processes: resume "
            f"it with {saved} processes (as many as trained it)")
    return state


class _OwnShare:
    """Whether this process's share of the pending save is written: every commit future its item handlers
    returned has ended. Then orbax only waits for the other processes (at its ``async_write_complete``
    barrier), and if the save outlives the checkpoint deadline, the processes whose share is not written
    are the ones whose storage stopped answering: the line every process stops with names them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = 0

    def begin(self) -> None:
        """A save starts (before its handlers run)."""
        with self._lock:
            self._open = 0

    def counted(self, futures):
        """``futures`` (a handler's commit futures), each telling this share when it has returned."""
        futures = list(futures or [])
        with self._lock:
            self._open += len(futures)
        return [_Counted(f, self) for f in futures]

    def one_written(self) -> None:
        with self._lock:
            self._open -= 1

    @property
    def written(self) -> bool:
        with self._lock:
            return self._open <= 0


OWN_SHARE = _OwnShare()


class _Counted:
    """A commit future (orbax's protocol: ``result``, ``cancel``) that tells ``share`` once it returned."""

    def __init__(self, inner, share: _OwnShare):
        self._inner, self._share, self._told = inner, share, False

    def result(self, timeout: float | None = None):
        out = self._inner.result(timeout=timeout)
        if not self._told:
            self._told = True
            self._share.one_written()
        return out

    def cancel(self):
        return self._inner.cancel()


class _StateHandler(ocp.PyTreeCheckpointHandler):
    """orbax's PyTree handler whose commit futures count in this process's share (``OWN_SHARE``)."""

    async def async_save(self, *args, **kwargs):
        return OWN_SHARE.counted(await super().async_save(*args, **kwargs))


def handlers():
    """The handlers of the two items, by item and arguments, so that a manager can read a checkpoint's
    metadata and restore from it without being told the items' types (and without orbax warning that it
    cannot). A registry of the manager's own: orbax's global one keeps naming its PyTree handler for
    ``PyTreeSave``/``PyTreeRestore`` everywhere else."""
    import grain  # noqa: PLC0415
    from orbax.checkpoint._src.handlers.handler_registration import DefaultCheckpointHandlerRegistry  # noqa: PLC0415

    event_loops.install()  # orbax's calls end cleanly when one of their reads or writes fails
    registry, state, data = DefaultCheckpointHandlerRegistry(), _StateHandler(), _data_iterator_handler()
    for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
        registry.add("state", args, state)
    for args in (grain.checkpoint.CheckpointSave, grain.checkpoint.CheckpointRestore):
        registry.add("data", args, data)
    return registry



def barriers_through_the_coordinator() -> None:
    """Multi-process: orbax's barriers through the JAX coordinator's key-value store (with timeouts)
    instead of device collectives. A collective barrier is a collective like any other: if one process
    left a save early, the others' barrier would be matched with that process's next collective (our
    agreement on the failure) and both would go on with the wrong data. Keyed barriers cannot be
    mistaken for anything else. (orbax reads this absl flag at each barrier; tieflax parses no absl
    flags, so the flag values are marked parsed to be readable.)"""
    if jax.process_count() == 1:
        return
    from absl import flags  # noqa: PLC0415

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True
