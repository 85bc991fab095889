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

The pieces: ``tieflax.run.orbax_handlers`` (the items' handlers), ``tieflax.run.save_watch`` (the
background saves and their failures), ``tieflax.run.checkpoint_errors`` (the errors).
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from tieflax import storage
from tieflax.run import record
from tieflax.run.checkpoint_errors import (CheckpointError, CheckpointMismatchError, ProcessCountError,  # noqa: F401
                                           quiet_abandoned_reads, why)
from tieflax.run.layout import CHECKPOINT_DIR, INITIAL_PARAMS_DIR, UNREADABLE_DIR, RunDir
from tieflax.run.orbax_handlers import OWN_SHARE, barriers_through_the_coordinator, handlers  # noqa: F401
from tieflax.run.saved_config import load_workdir_config, save_config
# Re-exported: the trainer, its stop and the tests reach the save watch through this module.
from tieflax.run.save_watch import (SAVE_DEADLINE_ENV, SaveDeadlinePassed, SaveWatch, save,  # noqa: F401
                                    save_deadline_seconds)

ITEMS = ("state", "data")


# ------------------------------------------------------------------------------------------------ manager

def checkpoint_dir(where: RunDir | str) -> str:
    """``<run>/checkpoints``."""
    return RunDir.of(where).file(CHECKPOINT_DIR)


def make_manager(where: RunDir, *, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
    """The run's manager over ``<run>/checkpoints`` with items ``state`` and ``data``."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    barriers_through_the_coordinator()
    folder = where.file(CHECKPOINT_DIR)
    storage.forget_listings(folder)
    return ocp.CheckpointManager(folder, handler_registry=handlers(), options=options)


def read_manager(where: RunDir | str, *, this_process_only: bool = False) -> ocp.CheckpointManager:
    """A manager for reading ``<run>/checkpoints`` (creates nothing). Readers go through the manager
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
    folder = checkpoint_dir(where)
    storage.forget_listings(folder)
    return ocp.CheckpointManager(folder, handler_registry=handlers(), options=options)



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


def save_initial_params(where: RunDir | str, config: ml_collections.ConfigDict, params: Any) -> str:
    """Writes ``config.json`` and ``initial_params/`` so that training in ``workdir`` starts from ``params``.

    ``params``: the model's ``params`` collection, boxed or unboxed, host NumPy or jax arrays. Its tree
    must be the one ``TransformerLM(model_config(config))`` creates (tied: no ``lm_head``). Returns the
    parameter directory. Call it on every process of a multi-process job (orbax coordinates the write).
    """
    import flax.linen as nn  # noqa: PLC0415

    where = RunDir.named(where)
    save_config(where, config)
    path = where.file(INITIAL_PARAMS_DIR)
    params = jax.tree.map(np.asarray, nn.unbox(params))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=True)
        ckptr.wait_until_finished()
    return path


def has_initial_params(where: RunDir) -> bool:
    return storage.is_dir(where.file(INITIAL_PARAMS_DIR))


def load_initial_params(where: RunDir, abstract_params: Any | None = None) -> Any:
    """``initial_params/`` onto ``abstract_params``' shardings, or as host NumPy when it is None."""
    path = where.file(INITIAL_PARAMS_DIR)
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


def latest_step(where: RunDir | str) -> int | None:
    """The newest checkpoint's step; None when the run has none."""
    where = RunDir.of(where)
    if not storage.is_dir(where.file(CHECKPOINT_DIR)):
        return None
    with read_manager(where, this_process_only=True) as manager:  # a listing: no barrier with the others
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
        quiet_abandoned_reads()
        raise CheckpointError(f"checkpoint {step} in {manager.directory} "
                              f"is unreadable ({why(e)}): rerun `tieflax train` in that workdir to set it "
                              "aside and resume from the newest readable checkpoint") from e
    return out.state["params"]


def load_latest_params(where: RunDir | str, step: int | None = None) -> tuple[ml_collections.ConfigDict, Any, int]:
    """``(config, params, step)`` of the latest checkpoint in the run ``where`` (or of checkpoint ``step``);
    params are host NumPy arrays. Only the parameters are read, never the optimizer state. ``where``: a
    ``RunDir``, or a path (a notebook's, a test's) resolved and checked here, once (``RunDir.of``).

    With no checkpoint yet, returns the ``initial_params/`` at step 0. Raises FileNotFoundError when the
    run has neither, or has no checkpoint at the ``step`` asked for.
    """
    config = load_workdir_config(where)  # first: a folder that is no run, or a broken record, says so
    return (config, *read_host_params(RunDir.of(where), step))


def read_host_params(where: RunDir, step: int | None = None) -> tuple[Any, int]:
    """``(params, step)``: ``load_latest_params`` without the config (a ``tieflax.run.read_only`` handle
    has read it once already)."""
    latest = latest_step(where)
    if latest is None and step in (None, 0):
        if has_initial_params(where):
            return load_initial_params(where), 0
        raise FileNotFoundError(f"{where.path!r} has no checkpoint and no initial_params/; train first.")
    step = latest if step is None else step
    if not storage.is_dir(where.file(CHECKPOINT_DIR, str(step), "state")):
        raise FileNotFoundError(f"{where.path!r} has no checkpoint at step {step}; the latest is {latest}.")
    with read_manager(where, this_process_only=True) as manager:  # host arrays: no other process takes part
        params = _read_params(manager, step, None)
    return _plain(params), step


def restore_latest_params(where: RunDir | str, abstract_params: Any) -> tuple[Any, int]:
    """``(params, step)``: the latest checkpoint's parameters onto ``abstract_params``' shardings (any
    mesh), or ``initial_params/`` at step 0. Only the parameters are read."""
    where = RunDir.of(where)
    step = latest_step(where)
    if step is None:
        if has_initial_params(where):
            return load_initial_params(where, abstract_params), 0
        raise FileNotFoundError(f"{where.path!r} has no checkpoint and no initial_params/; train first.")
    with read_manager(where) as manager:
        return _read_params(manager, step, abstract_params), step


# ------------------------------------------------------------------------------------------ resilience
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


def move_aside(where: RunDir, step: int) -> str:
    """Moves ``checkpoints/<step>`` to ``checkpoints_unreadable/<step>[-n]`` (kept, never deleted)."""
    target_dir = where.file(UNREADABLE_DIR)
    target, n = storage.join(target_dir, str(step)), 1
    while storage.exists(target):
        target, n = storage.join(target_dir, f"{step}-{n}"), n + 1
    storage.move_tree(where.file(CHECKPOINT_DIR, str(step)), target)
    return target


def unfinished_steps(where: RunDir) -> list[int]:
    """Steps (oldest first) whose checkpoint was begun and never finished (a save killed mid-write): never
    restored, never taken for a checkpoint written before the run's record carried digests."""
    return record.unfinished_steps(where)


def restore_newest_readable(manager: ocp.CheckpointManager, where: RunDir, abstract_state: Any, loader,
                            say) -> tuple[int | None, Any]:
    """``(step, state)`` of the newest checkpoint that restores, or ``(None, None)`` when there is none.

    Newer checkpoints that fail to restore are reported in one line each (step and why) through ``say``
    and moved to ``<run>/checkpoints_unreadable/`` (kept for inspection, never deleted). When none
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
            quiet_abandoned_reads()
            raise
        except Exception as e:  # noqa: BLE001 (orbax/tensorstore/JSON/OS: every way a file can be damaged)
            quiet_abandoned_reads()
            bad.append((step, why(e)))
            continue
        if bad:
            if jax.process_index() == 0:
                for b, reason in bad:
                    say(f"checkpoint {b} is unreadable ({reason}); moved it to {move_aside(where, b)}")
            manager.reload()
        return step, state
    if bad:
        steps = "; ".join(f"{b} ({reason[:120]})" for b, reason in bad)
        raise CheckpointError(f"no checkpoint in {where.file(CHECKPOINT_DIR)} is readable: Restore them from a "
                              f"backup, or move {CHECKPOINT_DIR}/ away to start again from step 0. Steps: {steps}")
    return None, None
