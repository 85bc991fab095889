"""Packing a token stream into fixed-length training rows with document boundaries.

A split is one flat stream of ids, ``[EOS d0 EOS d1 ... EOS]``: an EOS opens every document (and one
closes the last), so the last token of each document learns to predict EOS and the EOS learns to
predict a document's first token. Row ``i`` reads the window ``stream[i*T : i*T + T + 1]``:
``inputs = window[:-1]`` and ``targets = window[1:]``. Consecutive rows overlap by one token, so every
stream token is an input exactly once and every token but the first is a target exactly once:
nothing is dropped and no transition is lost at row edges. The last row is padded.

Row fields, all ``[T] int32``:

- ``inputs``: token ids; padding positions hold EOS.
- ``targets``: next-token ids; ``-1`` = ignored by the loss (padding, and with
  ``predict_first_token=False`` the EOS positions).
- ``segment_ids``: 1, 2, ... for each document piece in the row, 0 for padding. A new segment starts
  at every EOS (and at the row start).
- ``positions``: offset within the segment, restarting at 0 at each segment start, 0 for padding.

With ``document_masking=False`` a row is one segment (``segment_ids`` 1, ``positions`` 0..T-1), the
GPT-2 style of attending across documents.
"""

from __future__ import annotations

import numpy as np

IGNORE = -1  # target value the loss ignores


def num_rows(num_tokens: int, seq_len: int) -> int:
    """Rows a stream of ``num_tokens`` packs into at ``seq_len``: ceil((num_tokens - 1) / seq_len)."""
    return max(0, -(-(num_tokens - 1) // seq_len))


def pack_window(window: np.ndarray, seq_len: int, eos_id: int, *, document_masking: bool = True,
                predict_first_token: bool = True) -> dict[str, np.ndarray]:
    """One row from ``window``: ``[n]`` ids with ``2 <= n <= seq_len + 1`` (shorter = last row, padded).

    Returns ``inputs``, ``targets``, ``segment_ids``, ``positions``, each ``[seq_len] int32``.
    """
    t = seq_len
    n = len(window) - 1  # real positions in this row
    window = np.asarray(window, dtype=np.int32)
    inputs = np.full(t, eos_id, np.int32)
    targets = np.full(t, IGNORE, np.int32)
    inputs[:n] = window[:-1]
    targets[:n] = window[1:]
    valid = np.arange(t) < n
    is_eos = (inputs == eos_id) & valid
    idx = np.arange(t, dtype=np.int32)
    if document_masking:
        starts = is_eos.copy()
        starts[0] = True
        segment_ids = np.cumsum(starts, dtype=np.int32)
        positions = idx - np.maximum.accumulate(np.where(starts, idx, 0))
    else:
        segment_ids = np.ones(t, np.int32)
        positions = idx.copy()
    segment_ids[~valid] = 0
    positions[~valid] = 0
    if not predict_first_token:
        targets[is_eos] = IGNORE
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
            "positions": positions.astype(np.int32)}


def padding_row(seq_len: int, eos_id: int) -> dict[str, np.ndarray]:
    """An all-padding row (every target ignored), used to fill the last batch of a finite loader."""
    return {"inputs": np.full(seq_len, eos_id, np.int32),
            "targets": np.full(seq_len, IGNORE, np.int32),
            "segment_ids": np.zeros(seq_len, np.int32),
            "positions": np.zeros(seq_len, np.int32)}


class PackedRows:
    """Random access to the packed rows of a token stream: a grain ``RandomAccessDataSource``.

    ``tokens`` is a 1-D integer array, usually a read-only ``np.memmap``: a row reads only its own
    ``seq_len + 1`` ids, so a host touches only the rows it loads.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: int, *, document_masking: bool = True,
                 predict_first_token: bool = True):
        self.tokens = tokens
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.document_masking = document_masking
        self.predict_first_token = predict_first_token
        self._len = num_rows(len(tokens), seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} out of range [0, {self._len})")
        start = i * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1]
        return pack_window(window, self.seq_len, self.eos_id, document_masking=self.document_masking,
                           predict_first_token=self.predict_first_token)

    def __repr__(self) -> str:  # grain logs the source's repr; never print the token array
        return f"PackedRows(num_tokens={len(self.tokens)}, seq_len={self.seq_len}, rows={self._len})"
