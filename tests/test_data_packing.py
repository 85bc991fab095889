"""Packing: every token once, boundaries marked, padding ignored. Pure NumPy, checked against loops."""

import numpy as np
import pytest

from tieflax.data.packing import IGNORE, PackedRows, num_rows, pack_window

EOS = 0


def make_stream(doc_lengths, seed=0):
    """[EOS d0 EOS d1 ... EOS] with random non-EOS ids in 1..99."""
    rng = np.random.default_rng(seed)
    parts = []
    for n in doc_lengths:
        parts += [[EOS], rng.integers(1, 100, n)]
    return np.concatenate(parts + [[EOS]]).astype(np.uint16)


def oracle_row(window, seq_len):
    """Loop reference: segments start at row start and at each EOS; positions count from there."""
    inputs, targets, seg, pos = [], [], [], []
    s, p = 0, 0
    for j in range(seq_len):
        if j < len(window) - 1:
            x = int(window[j])
            if j == 0 or x == EOS:
                s, p = s + 1, 0
            inputs.append(x), targets.append(int(window[j + 1])), seg.append(s), pos.append(p)
            p += 1
        else:
            inputs.append(EOS), targets.append(IGNORE), seg.append(0), pos.append(0)
    return dict(inputs=inputs, targets=targets, segment_ids=seg, positions=pos)


@pytest.mark.parametrize("seq_len", [4, 7, 16])
def test_rows_match_loop_oracle_and_cover_every_token_once(seq_len):
    stream = make_stream([3, 1, 9, 5, 12, 2])
    rows = PackedRows(stream, seq_len, EOS)
    assert len(rows) == num_rows(len(stream), seq_len) == -(-(len(stream) - 1) // seq_len)
    all_inputs, all_targets = [], []
    for i in range(len(rows)):
        row = rows[i]
        window = stream[i * seq_len:i * seq_len + seq_len + 1]
        want = oracle_row(window, seq_len)
        for k in want:
            assert row[k].dtype == np.int32 and row[k].shape == (seq_len,)
            np.testing.assert_array_equal(row[k], want[k], err_msg=f"row {i} field {k}")
        valid = row["segment_ids"] > 0
        all_inputs.append(row["inputs"][valid])
        all_targets.append(row["targets"][valid])
    # Every token is an input exactly once and every token after the first a target exactly once.
    np.testing.assert_array_equal(np.concatenate(all_inputs), stream[:-1])
    np.testing.assert_array_equal(np.concatenate(all_targets), stream[1:])
    with pytest.raises(IndexError):
        rows[len(rows)]


def test_boundaries_segments_and_positions_by_hand():
    #                 EOS a b EOS c EOS d e f | next
    window = np.array([0, 5, 6, 0, 7, 0, 8, 9, 4, 3])
    row = pack_window(window, 9, EOS)
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 0, 1, 2, 3])
    np.testing.assert_array_equal(row["targets"], [5, 6, 0, 7, 0, 8, 9, 4, 3])
    # A row that starts mid-document opens segment 1 at position 0.
    row = pack_window(np.array([5, 6, 0, 7]), 3, EOS)
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 2])
    np.testing.assert_array_equal(row["positions"], [0, 1, 0])


def test_options_first_token_mask_and_no_document_masking():
    window = np.array([0, 5, 6, 0, 7, 0])
    row = pack_window(window, 8, EOS, predict_first_token=False)
    np.testing.assert_array_equal(row["targets"], [-1, 6, 0, -1, 0, -1, -1, -1])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 0, 0, 0])
    row = pack_window(window, 8, EOS, document_masking=False)
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(row["targets"], [5, 6, 0, 7, 0, -1, -1, -1])


def test_batched_rows_equal_single_rows_and_minus_one_is_padding():
    stream = make_stream([3, 1, 9, 5, 12, 2])
    rows = PackedRows(stream, 5, EOS, predict_first_token=False)
    ids = np.array([len(rows) - 1, 0, -1, 2])
    batch = rows.rows(ids)
    for r, i in enumerate(ids):
        for k, v in batch.items():
            assert v.shape == (4, 5) and v.dtype == np.int32
            if i >= 0:
                np.testing.assert_array_equal(v[r], rows[i][k], err_msg=k)
    np.testing.assert_array_equal(batch["targets"][2], [IGNORE] * 5)
    np.testing.assert_array_equal(batch["segment_ids"][2], [0] * 5)


def test_bos_opens_documents_and_is_never_a_target():
    bos = 2
    #                 BOS a b EOS BOS c EOS BOS d
    window = np.array([2, 5, 6, 0, 2, 7, 0, 2, 8])
    row = pack_window(window, 8, EOS, bos_id=bos)
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(row["targets"], [5, 6, 0, -1, 7, 0, -1, 8])
    row = pack_window(window, 8, EOS, bos_id=bos, predict_first_token=False)
    np.testing.assert_array_equal(row["targets"], [-1, 6, 0, -1, -1, 0, -1, -1])
