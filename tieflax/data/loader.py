"""The grain loader: shuffled packed rows, this process's share of each global batch, exact resume.

Global batch ``s`` is rows ``[s*G, (s+1)*G)`` of one seeded, epoch-reshuffled order of all rows, the
same on every process; process ``p`` of ``P`` takes the ``p``-th contiguous ``G/P`` of it. So the data a
step sees depends on the seed and the step only, not on the number of hosts, and the processes' shares
are disjoint and together cover the global batch. A process reads only its own rows.

Resume: the iterator's ``get_state()`` is a small JSON-able dict and ``set_state()`` restores it
exactly. Save it in the same orbax step as the parameters with grain's handler::

    import grain, orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(ckpt_dir, item_names=("state", "data"))
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                            data=grain.checkpoint.CheckpointSave(loader)))
    # on restart, after building the same loader:
    mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                               data=grain.checkpoint.CheckpointRestore(loader)))

The handler writes one ``process_<i>-of-<n>.json`` per process, and grain's restores only onto the
same number of processes. The state of an iterator of ``make_loader`` is ``{"next_index": k}``, the
global batches it returned, the same on every process and meaning the same on any number of them:
``state_for_processes`` turns the saved files into the state for another number of processes (tieflax's
checkpoint handler, ``tieflax.run.checkpoints``, does so on restore). Rebuilding the loader with
``start_step=<steps done>`` resumes the same way without a saved state.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Mapping, Sequence

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tieflax.data.config import DataError
from tieflax.data.packing import PackedRows, num_rows
from tieflax.data.cache import PreparedDataset
from tieflax.sharding import BATCH_AXES


# Above this many rows a NumPy permutation (8 bytes a row, two epochs cached) costs too much memory;
# grain's O(1)-memory index shuffle takes over, at ~10x the CPU per row.
NUMPY_SHUFFLE_MAX_ROWS = 1 << 24


class _MicroBatchRowIds:
    """Micro-batch ``k`` -> the ``[b]`` row ids it holds (``-1`` = an all-padding row).

    Rows are taken in epoch order; epoch ``e`` visits them in the permutation
    ``np.random.default_rng([seed, e]).permutation(n)`` (identity without shuffle), or, above
    ``NUMPY_SHUFFLE_MAX_ROWS`` rows, in grain's ``MapDataset.range(n).shuffle(seed).repeat()`` order.
    A finite loader ends with all-padding rows up to a whole global batch, so every process runs the
    same steps. The NumPy permutation depends on NumPy's ``default_rng`` stream: keep NumPy's version
    fixed between saving and restoring a loader state for an exact resume.
    """

    def __init__(self, num_rows_: int, batch: int, global_batch: int, *, seed: int, shuffle: bool,
                 num_epochs: int | None):
        self._n, self._b, self._seed, self._shuffle = num_rows_, batch, seed, shuffle
        if num_epochs is None:
            self._rows_total, self._len = None, sys.maxsize
        else:
            self._rows_total = num_rows_ * num_epochs
            self._len = -(-self._rows_total // global_batch) * (global_batch // batch)
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # grain reads with several threads
        self._grain_order = None
        if shuffle and num_rows_ > NUMPY_SHUFFLE_MAX_ROWS:
            self._grain_order = grain.MapDataset.range(num_rows_).shuffle(seed=seed).repeat()

    def __len__(self) -> int:
        return self._len

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._perms:
                if len(self._perms) >= 2:  # threads work on at most two adjacent epochs
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = np.random.default_rng([self._seed, epoch]).permutation(self._n)
            return self._perms[epoch]

    def __getitem__(self, k: int) -> np.ndarray:
        flat = k * self._b + np.arange(self._b, dtype=np.int64)  # positions in the row stream
        epoch, within = np.divmod(flat, self._n)
        ids = within.copy()
        if self._grain_order is not None:
            ids = np.array([self._grain_order[int(f)] for f in flat], np.int64) % self._n
        elif self._shuffle:
            for e in np.unique(epoch):
                ids[epoch == e] = self._perm(int(e))[within[epoch == e]]
        if self._rows_total is not None:
            ids[flat >= self._rows_total] = -1
        return ids


def steps_per_epoch(prepared: PreparedDataset, split: str, *, seq_len: int,
                    global_batch_size: int) -> int:
    """Global batches in one pass over ``split``; the last is completed with padding rows."""
    return math.ceil(num_rows(len(prepared.tokens(split)), seq_len) / global_batch_size)


def make_loader(prepared: PreparedDataset, split: str, *, seq_len: int, global_batch_size: int,
                seed: int, shuffle: bool = True, num_epochs: int | None = None,
                process_index: int | None = None, process_count: int | None = None,
                start_step: int = 0) -> grain.DatasetIterator:
    """An iterator over this process's share of each global batch of ``split``.

    Each element is a dict of ``[b, T]`` int32 NumPy arrays, ``b = global_batch_size / process_count``,
    ``T = seq_len`` (see :mod:`tieflax.data.packing` for the exact layout):

    - ``inputs``: token ids. The model must read these.
    - ``targets``: next-token ids; negative = ignored. The loss must honour these (mean over
      ``targets >= 0``): padding, BOS targets, and documents' first tokens when
      ``data.predict_first_token`` is False.
    - ``segment_ids``: document id within the row (0 = padding). The model must honour these for
      documents to be independent: position q attends to k only if ``k <= q`` and their segment ids
      are equal. A model that ignores them trains GPT-2 style across documents, which is still sound.
    - ``positions``: offset within the document, restarting at each one; use these instead of
      ``arange(T)`` for position embeddings / RoPE together with ``segment_ids``.

    Args:
      prepared: from :func:`tieflax.data.prepare_dataset`.
      split: 'train' or 'val'.
      seq_len: T, tokens per row.
      global_batch_size: rows per step over all processes; a multiple of ``process_count``.
      seed: shuffle seed (0 <= seed < 2**32); each epoch is reshuffled from it.
      shuffle: False keeps stream order (evaluation).
      num_epochs: None repeats forever (training); an integer stops after that many passes, the last
        global batch completed with all-padding rows so nothing is dropped.
      process_index, process_count: default to ``jax.process_index()`` / ``jax.process_count()``.
      start_step: begin at this global batch. The batches depend only on the seed and the step, so
        this resumes exactly without a saved iterator state, also on a different number of
        processes (whose saved per-process states would not match).

    Returns:
      A ``grain.DatasetIterator``; ``get_state()`` / ``set_state()`` resume it exactly.
    """
    p = jax.process_index() if process_index is None else process_index
    n_proc = jax.process_count() if process_count is None else process_count
    if not 0 <= p < n_proc:
        raise DataError(f"process_index = {p} must lie in [0, process_count = {n_proc}).")
    if global_batch_size <= 0 or global_batch_size % n_proc:
        raise DataError(f"global_batch_size = {global_batch_size} must be a positive multiple of the "
                        f"{n_proc} processes; change the training batch size.")
    if seq_len <= 0:
        raise DataError(f"seq_len = {seq_len} must be positive.")
    if not 0 <= seed < 2**32:
        raise DataError(f"seed = {seed} must lie in [0, 2**32) for grain's shuffle.")
    if start_step < 0:
        raise DataError(f"start_step = {start_step} must be >= 0.")
    if num_epochs is not None and num_epochs <= 0:
        raise DataError(f"num_epochs = {num_epochs} must be positive, or None to repeat forever.")
    tokens = prepared.tokens(split)
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"the {split} split has {len(tokens)} tokens, fewer than one sequence of seq_len + 1 = "
            f"{seq_len + 1}. Lower seq_len, add text, or raise data.val_fraction (for 'val').")
    local_batch = global_batch_size // n_proc

    rows = PackedRows(tokens, seq_len, prepared.eos_id, bos_id=prepared.bos_id,
                      document_masking=prepared.document_masking,
                      predict_first_token=prepared.predict_first_token)
    # grain shards and checkpoints micro-batch indices; each micro-batch's row ids come from one NumPy
    # permutation per epoch, and its rows are read and packed together (vectorised). Shuffling and
    # batching single rows through grain measured ~2x slower end to end on the default corpus.
    batches = _MicroBatchRowIds(len(rows), local_batch, global_batch_size, seed=seed, shuffle=shuffle,
                                num_epochs=num_epochs)
    # Global batch s is micro-batches s*P .. s*P + P-1, so process p takes every P-th micro-batch
    # starting at p. Slicing a MapDataset is lazy: other processes' rows are never read.
    ds = grain.MapDataset.source(batches)[p::n_proc][start_step:].map(rows.rows)
    read = grain.ReadOptions(num_threads=prepared.read_threads,
                             prefetch_buffer_size=prepared.prefetch_buffer_size)
    iterator = iter(ds.to_iter_dataset(read))
    setattr(iterator, _GLOBAL_STEP_STATE, True)
    return iterator


# Marks the iterators of make_loader: their state counts global batches (see state_for_processes).
_GLOBAL_STEP_STATE = "_tieflax_state_counts_global_batches"


def state_for_processes(iterator, saved_states: Sequence[Mapping]) -> dict | None:
    """The state that puts ``iterator`` (on this run's processes) where the iterators that saved
    ``saved_states`` (one state per process of another number of processes) were; None when that
    cannot be said: ``iterator`` is not one of ``make_loader``, or the saved states are not all the same
    ``{"next_index": k}``.

    An iterator of ``make_loader`` returns one micro-batch per global batch on every process, so its
    ``next_index`` is the number of global batches it returned since its ``start_step``, whatever the
    number of processes, and global batch ``s`` is the same rows on any number of them. The restored
    loader must have the saved one's seed, global batch size and ``start_step``, as for any resume.
    """
    if not getattr(iterator, _GLOBAL_STEP_STATE, False) or not saved_states:
        return None
    first = saved_states[0]
    if (not isinstance(first, Mapping) or set(first) != {"next_index"}
            or type(first["next_index"]) is not int or first["next_index"] < 0
            or any(s != first for s in saved_states)):
        return None
    return {"next_index": first["next_index"]}


def to_global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh,
                    batch_axes: Sequence[str] = BATCH_AXES) -> dict[str, jax.Array]:
    """This process's ``[b, T]`` arrays -> global ``[b * process_count, T]`` jax.Arrays on ``mesh``.

    The batch dimension is sharded over ``batch_axes`` (replicated over the other mesh axes), with
    ``jax.make_array_from_process_local_data``; the local rows must be the ones the process's devices
    hold, which is how :func:`make_loader` splits a global batch.
    """
    sharding = NamedSharding(mesh, PartitionSpec(tuple(batch_axes)))
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    out = {}
    for name, x in local_batch.items():
        global_rows = x.shape[0] * jax.process_count()
        if global_rows % shards:
            raise DataError(f"global batch of {global_rows} rows cannot be split over the {shards} "
                            f"devices of mesh axes {tuple(batch_axes)}; make the batch size a multiple "
                            f"of {shards}.")
        out[name] = jax.make_array_from_process_local_data(sharding, x)
    return out
