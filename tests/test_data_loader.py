"""The grain loader: determinism, exact resume (also through orbax), per-process shards, global arrays."""

from pathlib import Path

import grain
import jax
import numpy as np
import pytest

from tieflax.data import DataError, PreparedDataset, make_loader, steps_per_epoch, to_global_batch
from tieflax.data.packing import PackedRows
from tieflax.sharding import make_mesh

EOS = 0
T = 8


@pytest.fixture(scope="module")
def prepared():
    """A synthetic prepared dataset: 1000 distinct-ish ids in documents of 1..20 tokens."""
    rng = np.random.default_rng(0)
    parts = []
    for _ in range(60):
        parts += [[EOS], rng.integers(1, 500, rng.integers(1, 21))]
    train = np.concatenate(parts + [[EOS]]).astype(np.uint16)
    val = train[:50].copy()
    val[-1] = EOS
    return PreparedDataset(train_tokens=train, val_tokens=val, token_counts=np.bincount(train, minlength=500),
                           vocab_size=500, eos_id=EOS, tokenizer=None, data_dir=Path("."), info={},
                           read_threads=2, prefetch_buffer_size=8)


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) == ["inputs", "positions", "segment_ids", "targets"]
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_same_seed_same_batches_other_seed_other_batches(prepared):
    a = take(make_loader(prepared, "train", seq_len=T, global_batch_size=4, seed=3), 12)
    b = take(make_loader(prepared, "train", seq_len=T, global_batch_size=4, seed=3), 12)
    c = take(make_loader(prepared, "train", seq_len=T, global_batch_size=4, seed=4), 12)
    assert_batches_equal(a, b)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))
    assert a[0]["inputs"].shape == (4, T) and a[0]["inputs"].dtype == np.int32


def test_restored_state_gives_exactly_the_next_batches(prepared):
    # Run past an epoch boundary (rows per epoch ~ 100 / 4 per batch) so reshuffling is covered too.
    kw = dict(seq_len=T, global_batch_size=4, seed=7)
    ref = take(make_loader(prepared, "train", **kw), 40)
    it = make_loader(prepared, "train", **kw)
    take(it, 29)
    state = it.get_state()
    fresh = make_loader(prepared, "train", **kw)
    fresh.set_state(state)
    assert_batches_equal(take(fresh, 11), ref[29:])


def test_start_step_resumes_without_state_on_another_process_count(prepared):
    kw = dict(seq_len=T, global_batch_size=4, seed=7)
    ref = take(make_loader(prepared, "train", **kw), 40)
    assert_batches_equal(take(make_loader(prepared, "train", start_step=29, **kw), 11), ref[29:])
    halves = [take(make_loader(prepared, "train", start_step=29, process_index=p, process_count=2,
                               **kw), 11) for p in range(2)]
    joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*halves)]
    assert_batches_equal(joined, ref[29:])


def test_resume_through_orbax_with_grain_handler(prepared, tmp_path):
    """The recipe in the loader's docstring: save the iterator in the same orbax step as the params."""
    import orbax.checkpoint as ocp
    kw = dict(seq_len=T, global_batch_size=4, seed=1)
    ref = take(make_loader(prepared, "train", **kw), 10)
    it = make_loader(prepared, "train", **kw)
    take(it, 6)
    params = {"w": np.arange(3.0)}
    with ocp.CheckpointManager(tmp_path, item_names=("state", "data")) as mngr:
        mngr.save(6, args=ocp.args.Composite(state=ocp.args.StandardSave(params),
                                             data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
    fresh = make_loader(prepared, "train", **kw)
    with ocp.CheckpointManager(tmp_path, item_names=("state", "data")) as mngr:
        out = mngr.restore(6, args=ocp.args.Composite(state=ocp.args.StandardRestore(params),
                                                      data=grain.checkpoint.CheckpointRestore(fresh)))
    np.testing.assert_array_equal(out.state["w"], params["w"])
    assert_batches_equal(take(out.data, 4), ref[6:])


def test_process_shares_are_disjoint_and_form_the_global_batch(prepared):
    g, n_proc = 8, 4
    whole = take(make_loader(prepared, "train", seq_len=T, global_batch_size=g, seed=5), 15)
    shares = [take(make_loader(prepared, "train", seq_len=T, global_batch_size=g, seed=5,
                               process_index=p, process_count=n_proc), 15) for p in range(n_proc)]
    for step in range(15):
        for k in whole[step]:
            parts = [shares[p][step][k] for p in range(n_proc)]
            assert all(x.shape == (g // n_proc, T) for x in parts)
            np.testing.assert_array_equal(np.concatenate(parts), whole[step][k])


def test_one_epoch_covers_every_row_once_with_padding_rows_at_the_end(prepared):
    rows = PackedRows(prepared.train_tokens, T, EOS)
    g, n_proc = 8, 2
    steps = steps_per_epoch(prepared, "train", seq_len=T, global_batch_size=g)
    assert steps == -(-len(rows) // g)
    seen, num_pad = [], 0
    for p in range(n_proc):
        batches = list(make_loader(prepared, "train", seq_len=T, global_batch_size=g, seed=0,
                                   num_epochs=1, process_index=p, process_count=n_proc))
        assert len(batches) == steps  # every process runs the same number of steps
        for b in batches:
            for r in range(len(b["inputs"])):
                if b["segment_ids"][r].any():
                    seen.append(tuple(b["inputs"][r]))
                else:  # an all-padding row: the loss must ignore all of it
                    assert (b["targets"][r] < 0).all()
                    num_pad += 1
    want = sorted(tuple(rows[i]["inputs"]) for i in range(len(rows)))
    assert sorted(seen) == want
    assert num_pad == steps * g - len(rows) > 0


def test_each_epoch_is_reshuffled(prepared):
    n = len(PackedRows(prepared.train_tokens, T, EOS))
    ep = list(make_loader(prepared, "train", seq_len=T, global_batch_size=1, seed=0, num_epochs=2))
    first = [tuple(b["inputs"][0]) for b in ep[:n]]
    second = [tuple(b["inputs"][0]) for b in ep[n:]]
    assert sorted(first) == sorted(second) and first != second


@pytest.mark.parametrize("large", [False, True])
def test_each_epoch_is_a_permutation_in_both_shuffle_regimes(prepared, monkeypatch, large):
    from tieflax.data import loader as loader_lib
    if large:  # pretend the corpus is huge: grain's O(1)-memory shuffle instead of NumPy's
        monkeypatch.setattr(loader_lib, "NUMPY_SHUFFLE_MAX_ROWS", 10)
    n = len(PackedRows(prepared.train_tokens, T, EOS))
    ids = loader_lib._MicroBatchRowIds(n, 1, 1, seed=3, shuffle=True, num_epochs=2)
    assert (ids._grain_order is not None) == large
    order = np.concatenate([ids[k] for k in range(2 * n)])
    again = loader_lib._MicroBatchRowIds(n, 1, 1, seed=3, shuffle=True, num_epochs=2)
    np.testing.assert_array_equal(order, np.concatenate([again[k] for k in range(2 * n)]))
    for epoch in order.reshape(2, n):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(n))
    assert not np.array_equal(order[:n], order[n:]) and not np.array_equal(order[:n], np.arange(n))


def test_to_global_batch_on_an_eight_device_mesh(prepared):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    local = next(make_loader(prepared, "val", seq_len=T, global_batch_size=8, seed=0))
    out = to_global_batch(local, mesh)
    for k, v in out.items():
        assert isinstance(v, jax.Array) and v.shape == (8, T)
        assert v.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
        np.testing.assert_array_equal(np.asarray(v), local[k])
    with pytest.raises(DataError, match="multiple of 4"):
        to_global_batch({k: v[:2] for k, v in local.items()}, mesh)


def test_bad_loader_arguments_name_the_fix(prepared):
    with pytest.raises(DataError, match="fewer than one sequence"):
        make_loader(prepared, "val", seq_len=64, global_batch_size=2, seed=0)
    with pytest.raises(DataError, match="multiple of the 3 processes"):
        make_loader(prepared, "train", seq_len=T, global_batch_size=4, seed=0, process_index=0,
                    process_count=3)
    with pytest.raises(DataError, match="split 'test'"):
        make_loader(prepared, "test", seq_len=T, global_batch_size=4, seed=0)
