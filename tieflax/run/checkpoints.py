"""A run's checkpoints: ``checkpoints/<step>/{state,data}`` and ``initial_params/`` (see
``tieflax.run.layout`` for the whole run directory).

    checkpoints/<step>/state   {'step', 'params', 'opt_state'}: orbax (tensorstore / OCDBT), per-array sharded
    checkpoints/<step>/data    the grain iterator state, one JSON per process

Checkpoints go through ``orbax.checkpoint.CheckpointManager``: asynchronous, atomic (a step directory
exists only once complete), ``keep`` most recent kept. Arrays restore onto whatever shardings the
restoring run asks for, so a run saved on an ``8x1`` mesh resumes on ``2x4``, and the data position
moves to another number of processes (``_state_of_other_process_count``). Readers go through a
manager with the same item handlers as the writer (``read_manager``), which knows the layout: a healthy
checkpoint reads without a warning. ``restore_newest_readable`` sets damaged checkpoints aside;
``SaveWatch`` turns a failed background save into an error at the next step.

Contract for converters and notebooks:

* ``save_initial_params(workdir, config, params)``: writes ``config.json`` and ``initial_params/``; a
  later ``tieflax train --workdir workdir`` (or ``train_and_evaluate(config, workdir)``) with no
  checkpoint yet starts from these parameters with a fresh optimizer at step 0.
* ``load_latest_params(workdir) -> (config, params, step)``: the latest checkpoint's parameters as host
  NumPy arrays (unboxed), or the initial parameters at step 0 when no checkpoint exists yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from tieflax import storage
from tieflax.errors import UserError
from tieflax.run import event_loops, layout, save_start
from tieflax.run import identity
from tieflax.run.identity import save_config
from tieflax.run.layout import CHECKPOINT_DIR, INITIAL_PARAMS_DIR, UNREADABLE_DIR, check_location

ITEMS = ("state", "data")
log = logging.getLogger(__name__)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the step or folder and what to do."""


# ------------------------------------------------------------------------------------------------ manager

def checkpoint_dir(workdir: str) -> str:
    check_location(workdir)
    return layout.path(workdir, CHECKPOINT_DIR)


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


def _handlers():
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


def _barriers_through_the_coordinator() -> None:
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


def make_manager(workdir: str, *, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
    """The run's manager over ``<workdir>/checkpoints`` with items ``state`` and ``data``."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    _barriers_through_the_coordinator()
    storage.forget_listings(checkpoint_dir(workdir))
    return ocp.CheckpointManager(checkpoint_dir(workdir), handler_registry=_handlers(), options=options)


def read_manager(workdir: str, *, this_process_only: bool = False) -> ocp.CheckpointManager:
    """A manager for reading ``<workdir>/checkpoints`` (creates nothing). Readers go through the manager
    that wrote the checkpoints: it knows the layout (``_CHECKPOINT_METADATA`` sits at the step, not in
    the item folder), so a healthy checkpoint reads without warnings. ``this_process_only``: a reader of
    one process of a multi-process job (host arrays), which must not wait at orbax's barriers for the
    others (compare's analysis on process 0 while process 1 trains the next run)."""
    # Not `read_only=True`: orbax warns "directory is read only" for every such manager. A manager that
    # never saves writes nothing either.
    alone = {}
    if this_process_only and jax.process_count() > 1:
        me = jax.process_index()
        alone = dict(multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"tieflax-reader-{me}"))
    options = ocp.CheckpointManagerOptions(create=False, **alone)
    storage.forget_listings(checkpoint_dir(workdir))
    return ocp.CheckpointManager(checkpoint_dir(workdir), handler_registry=_handlers(), options=options)


def save(manager: ocp.CheckpointManager, step: int, state: Any, loader) -> None:
    """Saves the train state and the data iterator in the same step (asynchronously). The step's metadata
    names the run's record entry in force (``identity.in_force``), so that a deleted or edited entry is
    found on resume."""
    import grain  # noqa: PLC0415

    manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                               data=grain.checkpoint.CheckpointSave(loader)), force=True,
                 custom_metadata=_record_in_force(manager))


def _record_in_force(manager: ocp.CheckpointManager) -> dict:
    """``{identity.RECORD_KEY: ...}``, read once per manager: the record is written before the first save
    and does not change while the manager saves."""
    named = getattr(manager, "_tieflax_record", None)
    if named is None:
        workdir = str(manager.directory).rstrip("/").rsplit("/", 1)[0]  # <workdir>/checkpoints
        named = {identity.RECORD_KEY: identity.in_force(workdir)} if jax.process_index() == 0 else {}
        manager._tieflax_record = named
    return named


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any, loader) -> Any:
    """Restores ``step`` onto the shardings of ``abstract_state`` (``jax.ShapeDtypeStruct`` leaves with
    ``.sharding``) and the data iterator in place; returns the state."""
    import grain  # noqa: PLC0415

    state = ocp.args.PyTreeRestore(abstract_state,
                                   restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
    out = manager.restore(step, args=ocp.args.Composite(state=state,
                                                        data=grain.checkpoint.CheckpointRestore(loader)))
    return out.state


# ------------------------------------------------------------------------------------------------ params

def _numpy_restore_args(metadata: Any) -> Any:
    return jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), metadata)


def save_initial_params(workdir: str, config: ml_collections.ConfigDict, params: Any) -> str:
    """Writes ``config.json`` and ``initial_params/`` so that training in ``workdir`` starts from ``params``.

    ``params``: the model's ``params`` collection, boxed or unboxed, host NumPy or jax arrays. Its tree
    must be the one ``TransformerLM(model_config(config))`` creates (tied: no ``lm_head``). Returns the
    parameter directory. Call it on every process of a multi-process job (orbax coordinates the write).
    """
    import flax.linen as nn  # noqa: PLC0415

    save_config(workdir, config)
    path = layout.path(workdir, INITIAL_PARAMS_DIR)
    params = jax.tree.map(np.asarray, nn.unbox(params))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=True)
        ckptr.wait_until_finished()
    return path


def has_initial_params(workdir: str) -> bool:
    return storage.is_dir(layout.path(workdir, INITIAL_PARAMS_DIR))


def load_initial_params(workdir: str, abstract_params: Any | None = None) -> Any:
    """``initial_params/`` onto ``abstract_params``' shardings, or as host NumPy when it is None."""
    path = layout.path(workdir, INITIAL_PARAMS_DIR)
    with ocp.StandardCheckpointer() as ckptr:
        if abstract_params is not None:
            return ckptr.restore(path, abstract_params)
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(path).item_metadata.tree
        return _plain(ckptr.restore(path, args=ocp.args.PyTreeRestore(
            restore_args=_numpy_restore_args(meta))))


def _plain(tree: Any) -> Any:
    """Nested plain dicts (orbax may hand back its own mapping types)."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def latest_step(workdir: str) -> int | None:
    if not storage.is_dir(checkpoint_dir(workdir)):
        return None
    with read_manager(workdir, this_process_only=True) as manager:  # a listing: no barrier with the others
        return manager.latest_step()


def _read_params(manager: ocp.CheckpointManager, step: int, abstract_params: Any | None) -> Any:
    """Checkpoint ``step``'s parameters only (a partial restore: never the 2x larger optimizer state),
    onto ``abstract_params``' shardings, or as host NumPy arrays when it is None. A damaged checkpoint is
    a CheckpointError naming the step; one of another model a CheckpointMismatchError."""
    try:
        if abstract_params is None:
            state_meta = manager.item_metadata(step)["state"]
            if state_meta is None:
                raise ValueError("its state metadata is missing")
            abstract_params = state_meta.tree["params"]
            restore_args = _numpy_restore_args(abstract_params)
        else:
            _check_same_model(manager, step, {"params": abstract_params})
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
        out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True)))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (orbax/tensorstore/JSON: every way a file can be damaged)
        _quiet_abandoned_reads()
        raise CheckpointError(f"checkpoint {step} in {manager.directory} "
                              f"is unreadable ({_why(e)}): rerun `tieflax train` in that workdir to set it "
                              "aside and resume from the newest readable checkpoint") from e
    return out.state["params"]


def load_latest_params(workdir: str, step: int | None = None) -> tuple[ml_collections.ConfigDict, Any, int]:
    """``(config, params, step)`` of the latest checkpoint in ``workdir`` (or of checkpoint ``step``);
    params are host NumPy arrays. Only the parameters are read, never the optimizer state.

    With no checkpoint yet, returns the ``initial_params/`` at step 0. Raises FileNotFoundError when the
    workdir has neither, or has no checkpoint at the ``step`` asked for.
    """
    from tieflax.run.identity import load_workdir_config  # noqa: PLC0415 (same floor)

    config = load_workdir_config(workdir)
    latest = latest_step(workdir)
    if latest is None and step in (None, 0):
        if has_initial_params(workdir):
            return config, load_initial_params(workdir), 0
        raise FileNotFoundError(f"{workdir!r} has no checkpoint and no initial_params/; train first.")
    step = latest if step is None else step
    if not storage.is_dir(storage.join(checkpoint_dir(workdir), str(step), "state")):
        raise FileNotFoundError(f"{workdir!r} has no checkpoint at step {step}; the latest is {latest}.")
    with read_manager(workdir, this_process_only=True) as manager:  # host arrays: no other process takes part
        params = _read_params(manager, step, None)
    return config, _plain(params), step


def restore_latest_params(workdir: str, abstract_params: Any) -> tuple[Any, int]:
    """``(params, step)``: the latest checkpoint's parameters onto ``abstract_params``' shardings (any
    mesh), or ``initial_params/`` at step 0. Only the parameters are read."""
    step = latest_step(workdir)
    if step is None:
        if has_initial_params(workdir):
            return load_initial_params(workdir, abstract_params), 0
        raise FileNotFoundError(f"{workdir!r} has no checkpoint and no initial_params/; train first.")
    with read_manager(workdir) as manager:
        return _read_params(manager, step, abstract_params), step


# ------------------------------------------------------------------------------------------ resilience
def _why(e: BaseException) -> str:
    """One short line for an orbax/tensorstore failure: the innermost cause's first line (the outer ones
    say "error while reading array index ..."; the inner one says what is wrong with which file)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in reversed(chain):
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        if first:
            return f"{type(err).__name__}: {first[:200]}"
    return type(chain[0]).__name__


def _tree_shapes(tree: Any) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): tuple(getattr(leaf, "shape", ())) for path, leaf in leaves}


def _check_same_model(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> None:
    """Raises CheckpointError (not "unreadable") when checkpoint ``step`` holds another model's tree."""
    meta = manager.item_metadata(step)["state"]
    if meta is None:
        raise ValueError("its state metadata is missing")
    saved, wanted = _tree_shapes(meta.tree["params"]), _tree_shapes(abstract_state["params"])
    if saved != wanted:
        diff = sorted(set(saved.items()) ^ set(wanted.items()))[:3]
        raise CheckpointMismatchError(
            f"checkpoint {step} holds a different model's parameters (first differences, (path, shape): "
            f"{diff}): train this model in a new --workdir, or use the config the run was trained with")


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint of another model (a config problem, not a damaged checkpoint)."""


class ProcessCountError(CheckpointError):
    """A readable checkpoint whose data position cannot be moved to this run's number of processes (a
    launch problem, not a damaged checkpoint): the message names both counts."""


def move_aside(workdir: str, step: int) -> str:
    """Moves ``checkpoints/<step>`` to ``checkpoints_unreadable/<step>[-n]`` (kept, never deleted)."""
    target_dir = layout.path(workdir, UNREADABLE_DIR)
    target, n = storage.join(target_dir, str(step)), 1
    while storage.exists(target):
        target, n = storage.join(target_dir, f"{step}-{n}"), n + 1
    storage.move_tree(storage.join(checkpoint_dir(workdir), str(step)), target)
    return target


def unfinished_steps(workdir: str) -> list[int]:
    """Steps (oldest first) whose checkpoint was begun and never finished (a save killed mid-write): never
    restored, never taken for a checkpoint written before the run's record carried digests."""
    return identity.unfinished_steps(workdir)


def restore_newest_readable(manager: ocp.CheckpointManager, workdir: str, abstract_state: Any, loader,
                            say) -> tuple[int | None, Any]:
    """``(step, state)`` of the newest checkpoint that restores, or ``(None, None)`` when there is none.

    Newer checkpoints that fail to restore are reported in one line each (step and why) through ``say``
    and moved to ``<workdir>/checkpoints_unreadable/`` (kept for inspection, never deleted). When none
    restores, nothing is moved and CheckpointError says what to do. A checkpoint of another model is a
    config problem: CheckpointMismatchError, nothing moved; one whose data position cannot be moved to
    this run's number of processes a launch problem: ProcessCountError, nothing moved.
    """
    bad: list[tuple[int, str]] = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            _check_same_model(manager, step, abstract_state)
            state = restore(manager, step, abstract_state, loader)
        except CheckpointMismatchError:
            raise
        except ProcessCountError:
            _quiet_abandoned_reads()
            raise
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore/JSON/OS: every way a file can be damaged)
            _quiet_abandoned_reads()
            bad.append((step, _why(e)))
            continue
        if bad:
            if jax.process_index() == 0:
                for b, why in bad:
                    say(f"checkpoint {b} is unreadable ({why}); moved it to {move_aside(workdir, b)}")
            manager.reload()
        return step, state
    if bad:
        steps = "; ".join(f"{b} ({why[:120]})" for b, why in bad)
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(workdir)} is readable: Restore them from a "
                              f"backup, or move {CHECKPOINT_DIR}/ away to start again from step 0. Steps: {steps}")
    return None, None


SAVE_DEADLINE_ENV = storage.CHECKPOINT_DEADLINE_ENV


def save_deadline_seconds() -> float:
    """How long the end of one asynchronous save may be waited for: ``TIEFLAX_CHECKPOINT_DEADLINE_S``,
    else 1800 s (and never less than the storage deadline). Read by the path layer
    (``storage.checkpoint_deadline_seconds``), which the console asks at a command's start: a bad value is
    refused there, before the first step, not here at a save."""
    try:
        value = storage.checkpoint_deadline_seconds()
    except storage.StorageError as e:
        raise CheckpointError(str(e)) from None
    return max(value, storage.deadline_seconds())


class SaveDeadlinePassed(CheckpointError):
    """A save on a bucket still running past the checkpoint deadline (multi-process: every process polls)."""

    def __init__(self, step: int, where: str, seconds: float):
        super().__init__(storage.no_answer(where, f"finish checkpoint {step} in", seconds, SAVE_DEADLINE_ENV))
        self.step, self.where, self.seconds = step, where, seconds


class SaveWatch:
    """Starts asynchronous saves and surfaces a failed one at the first step after orbax reports it ended
    (and at the latest when the next save would start), as a CheckpointError whose
    message ends with the OS error (a full disk, a lost mount), instead of training on without saving."""

    def __init__(self, manager: ocp.CheckpointManager):
        self.manager = manager
        self.pending: int | None = None
        self.starting: save_start.SaveStart | None = None  # the last start (several processes)
        self._started = 0.0  # when the pending save started (monotonic)
        # A bucket that stops answering for less than the checkpoint deadline is ridden out: the save it broke
        # is said in one line, training goes on, the next save tries again (the last one is retried here);
        # _outage_since: when the first save of such an outage started.
        self._outage_since: float | None = None
        self._saving: tuple | None = None  # (step, state, loader) of the pending save
        self._quiet = _QuietOrbaxSaveErrors()
        logging.getLogger("absl").addFilter(self._quiet)

    def start(self, step: int, state: Any, loader) -> None:
        """Starts saving ``step`` (orbax's blocking part; the writes go on in the background). With several
        processes, ``starting`` then holds this start, for every process to agree on how it ended
        (``tieflax.train.stop.agree_on_start``)."""
        self.starting = self._save_start(step) if jax.process_count() > 1 else None
        self._raise_if_failed(wait=True)  # orbax waits for the previous save anyway
        # A bucket that stops answering would hold orbax's start of a save (gcsfs, tensorstore) forever:
        # past the storage deadline the process says so in one line and exits 1 (the step not committed);
        # with several processes, the line every process stops with (save_start.SaveStart.ran_out), at once
        # for a process waiting at orbax's barrier for one whose start failed (SaveStart.listening).
        self._started = time.monotonic()
        OWN_SHARE.begin()
        listening = self.starting.listening() if self.starting is not None else contextlib.nullcontext()
        with storage.watchdog(self._where(), f"save checkpoint {step} to",
                              ran_out=self.starting.ran_out if self.starting is not None else None), listening:
            try:
                save(self.manager, step, state, loader)
            except Exception as e:  # noqa: BLE001
                if self._ride_out(step, e):
                    self._saving = (step, state, loader)
                    return
                raise self._error(step, e) from e
        self.pending = step
        self._started = time.monotonic()
        self._saving = (step, state, loader)

    def _save_start(self, step: int) -> save_start.SaveStart:
        """This start, as the processes agree on it, with the bound of that agreement (each process's wait
        for the others' words once its own start ended): on a bucket twice the storage deadline (every
        process's start ends within that deadline, on its watchdog at the latest; the second one leaves
        room for the skew between the processes' starts and for their words); on a local disk, where no
        watchdog ends a start, the checkpoint deadline."""
        if storage.is_remote(self._where()):
            return save_start.SaveStart(step, self._where(), 2 * storage.deadline_seconds(), storage.DEADLINE_ENV)
        return save_start.SaveStart(step, self._where(), save_deadline_seconds(), SAVE_DEADLINE_ENV)

    def _where(self) -> str:
        return str(getattr(self.manager, "directory", "")) or "checkpoints"

    where = property(_where, doc="The checkpoints' folder (for messages).")

    def check(self, step: int) -> None:
        """Cheap: only asks orbax whether the pending save has ended, and if so whether it failed."""
        if self.pending is not None and not self.manager.is_saving_in_progress():
            self._raise_if_failed(wait=True)

    def failure(self, wait: bool) -> "CheckpointError | None":
        """The pending save's failure, or None (still running when ``wait`` is False, or it succeeded).
        Multi-process training calls this on every process, then agrees (``distributed.first_failure``),
        so that a save failing on one process stops all of them at the same step."""
        if self.pending is None:
            return None
        # This process's own share failed? (`is_saving_in_progress` cannot say: with several processes it
        # stays True until every process has finished, a failed one included.)
        failed, self._quiet.commit_error = self._quiet.commit_error, None
        if failed is None:
            try:
                self.manager.check_for_errors()
            except Exception as e:  # noqa: BLE001
                failed = e
        if failed is not None:
            step, self.pending = self.pending, None
            return self._error(step, failed)
        if not wait and self.manager.is_saving_in_progress():
            # Multi-process training polls this, all processes together (never a blocking wait, which has
            # the watchdog below): a save that has not ended within the checkpoint deadline is a failure
            # every process agrees on, instead of polling a bucket that stopped answering forever.
            seconds = save_deadline_seconds()
            if storage.is_remote(self._where()) and time.monotonic() - self._started > seconds:
                step, self.pending = self.pending, None
                return SaveDeadlinePassed(step, self._where(), seconds)
            return None
        try:
            self._raise_if_failed(wait=True)
        except CheckpointError as e:
            return e
        return None

    def _raise_if_failed(self, wait: bool) -> bool:
        """Waits for the pending save; raises CheckpointError if it failed, except for a bucket that stopped
        answering within the checkpoint deadline: then True (ridden out, said in one line)."""
        if self.pending is None:
            return False
        step, self.pending = self.pending, None
        # The rest of a save (its arrays, its commit marker) may take long on a large model, but not
        # forever: TIEFLAX_CHECKPOINT_DEADLINE_S (default 30 min), then one line and exit 1.
        with storage.watchdog(self._where(), f"finish checkpoint {step} in", save_deadline_seconds(),
                              SAVE_DEADLINE_ENV):
            try:
                self.manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                if self._ride_out(step, e):
                    return True
                raise self._error(step, e) from e
        self._outage_since = None  # a save went through: any outage is over
        return False

    def _ride_out(self, step: int, e: BaseException) -> bool:
        """True when ``e`` is a bucket that did not answer and the outage (since the first save it broke
        started) is still within the checkpoint deadline; past it, CheckpointError naming the object,
        the bucket and the deadline. One process only: several must agree (``failure``), and stop."""
        where = self._where()
        if jax.process_count() > 1 or not storage.is_remote(where) or not storage.is_no_answer(e):
            return False
        since = self._started if self._outage_since is None else self._outage_since
        seconds = save_deadline_seconds()
        if time.monotonic() - since >= seconds:
            raise CheckpointError(self._no_answer_line(step, e, seconds)) from e
        self._outage_since = since
        log.warning("checkpoint %d was not saved: no answer from %s (%s); training goes on and the next save "
                    "tries again, within the %g s checkpoint deadline (%s)", step, _bucket_of(where),
                    storage.object_named_in(e, where) or where, seconds, SAVE_DEADLINE_ENV)
        return True

    def _no_answer_line(self, step: int, e: BaseException, seconds: float) -> str:
        where = self._where()
        return (f"saving checkpoint {step} failed, training stopped: no answer from {_bucket_of(where)} within "
                f"the {seconds:g} s checkpoint deadline ({SAVE_DEADLINE_ENV}) for "
                f"{storage.object_named_in(e, where) or where}; check the network and that the bucket is reachable, "
                "then rerun to resume from the last checkpoint")

    def _retry_last(self) -> None:
        """The last save broken by a bucket that stopped answering: saved again (its partial objects first
        deleted) until it goes through or the checkpoint deadline since the outage began has passed."""
        step, state, loader = self._saving
        pause = 1.0
        while True:
            time.sleep(pause)
            pause = min(2 * pause, 15.0)
            with contextlib.suppress(Exception):  # the bucket may still be silent: the save says so itself
                with storage.deadline_within(pause):
                    storage.rmtree(storage.join(checkpoint_dir_of(self.manager), str(step)))
            self.start(step, state, loader)  # rides out (nothing pending) or raises past the deadline
            if self.pending is not None and not self._raise_if_failed(wait=True):
                return

    def abandon(self) -> None:
        """After a failure every process agreed on: the pending save is not waited for (on the healthy
        processes it waits at orbax's commit barrier for the failed one, forever), nor is the manager
        closed. The process must then exit without joining orbax's save thread (``os._exit``)."""
        self.pending = None
        self._abandoned = True

    def close(self) -> None:
        """Waits for the last save and closes the manager; a failure is raised after the manager closed."""
        if getattr(self, "_abandoned", False):
            logging.getLogger("absl").removeFilter(self._quiet)
            return
        error = None
        try:
            if self._raise_if_failed(wait=True):
                self._retry_last()
        except CheckpointError as e:
            error = e
        try:
            self.manager.close()
        except Exception as e:  # noqa: BLE001 (closing after a failed save may fail the same way)
            error = error or self._error(-1, e)
        finally:
            logging.getLogger("absl").removeFilter(self._quiet)
        if error is not None:
            raise error

    def _error(self, step: int, e: BaseException) -> CheckpointError:
        where = f"saving checkpoint {step}" if step >= 0 else "finishing the last checkpoint"
        if storage.is_remote(self._where()) and storage.is_no_answer(e):  # never a disk's advice for a bucket
            return CheckpointError(self._no_answer_line(step, e, save_deadline_seconds()))
        os_error = _os_error_of(e)
        if os_error is not None and not (storage.is_remote(self._where()) and _is_network(e)):
            fix = "free space on that disk (or fix the mount), then rerun to resume from the last checkpoint"
            return CheckpointError(f"{where} failed, training stopped ({fix}): {os_error}")
        why = _why(e)
        if re.search(r"\b403\b|forbidden|permission_denied|access denied", why, re.IGNORECASE):
            return CheckpointError(f"{where} failed, training stopped (this account may not write there: grant "
                                   f"it write access, e.g. roles/storage.objectAdmin on the bucket, then rerun "
                                   f"to resume from the last checkpoint): {why}")
        return CheckpointError(f"{where} failed, training stopped (rerun to resume from the last checkpoint): "
                               f"{why}")


def _bucket_of(where: str) -> str:
    scheme, bucket, _ = storage.bucket_and_key(where)
    return f"{scheme}://{bucket}"


def _is_network(e: BaseException) -> bool:
    return not any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in storage._chain(e))


def checkpoint_dir_of(manager: ocp.CheckpointManager) -> str:
    return str(manager.directory).rstrip("/")


# tensorstore reports an OS failure inside a ValueError: '... "<file>": Failed writing: ... <strerror>
# [os_error_code='28']'.
_TENSORSTORE_OS_ERROR = re.compile(r'"([^"]+)"[^"]*?:\s*([^:\[]+?)\s*\[os_error_code=\'(\d+)\'\]')


def _os_error_of(e: BaseException) -> str | None:
    """``[Errno N] strerror: file`` of the OS failure behind ``e`` (Python's or tensorstore's), or None;
    one that names its file is preferred."""
    found, seen, todo = [], set(), [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            found.append((e.errno, e.strerror, e.filename))
        match = _TENSORSTORE_OS_ERROR.search(str(e))
        if match:
            path, text, code = match.groups()
            found.append((code, text.strip(), path.removesuffix(".__lock")))
        todo += [e.__cause__, e.__context__]
    if not found:
        return None
    code, text, path = sorted(found, key=lambda f: f[2] is None)[0]
    return f"[Errno {code}] {text}" + (f": {path}" if path else "")


class _QuietOrbaxSaveErrors(logging.Filter):
    """Drops orbax's own ERROR logs (tracebacks) of a failed background save: ``SaveWatch`` reports the
    failure itself, in one line that ends with the OS error.

    It also keeps the first failure orbax's save thread reports (``commit_error``). With several
    processes that report is how a process learns, at once, that its own share of a save failed: orbax
    hands the exception to its finalize thread, which then waits at a barrier for the other processes
    before anything public (``is_saving_in_progress``, ``check_for_errors``) says so."""

    commit_error: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        if record.exc_info and record.exc_info[1] is not None and self.commit_error is None:
            self.commit_error = record.exc_info[1]
        return False


def _quiet_abandoned_reads() -> None:
    """After a failed restore, orbax's other pending reads of that checkpoint finish on an event loop that
    is already closed: Python then prints "Event loop is closed" tracebacks and "Exception ignored in
    <coroutine _read_array_index_and_device_put>" with a full TensorStore spec, long after tieflax has
    reported the checkpoint in one line. These two kinds only are dropped; every other report stays."""
    if getattr(sys, "_tieflax_quiet_reads", False):
        return
    sys._tieflax_quiet_reads = True
    previous_unraisable, previous_except = sys.unraisablehook, sys.excepthook

    def abandoned(exc_value, obj=None) -> bool:
        if isinstance(exc_value, RuntimeError) and str(exc_value) == "Event loop is closed":
            return True
        return "orbax" in repr(obj) or "_read_array_index_and_device_put" in repr(obj)

    def unraisable(u):
        if not abandoned(u.exc_value, u.object):
            previous_unraisable(u)

    def excepthook(kind, value, tb):
        if not abandoned(value):
            previous_except(kind, value, tb)

    sys.unraisablehook, sys.excepthook = unraisable, excepthook
