"""Packing a token stream into fixed-length training rows with document boundaries.

A split is one flat stream of ids, ``[EOS d0 EOS d1 ... EOS]``: an EOS opens every document (and one
closes the last), so the last token of each document learns to predict EOS and the EOS learns to
predict a document's first token. With a BOS token configured (pretrained tokenizers such as Llama-3's
or Gemma's expect one) the stream is ``[BOS d0 EOS BOS d1 EOS ...]`` and BOS opens documents instead.
Row ``i`` reads the window ``stream[i*T : i*T + T + 1]``: ``inputs = window[:-1]`` and
``targets = window[1:]``. Consecutive rows overlap by one token, so every stream token is an input
exactly once and every token but the first is a target exactly once: nothing is dropped and no
transition is lost at row edges. The last row is padded.

Row fields, all ``[T] int32``:

- ``inputs``: token ids; padding positions hold EOS.
- ``targets``: next-token ids; ``-1`` = ignored by the loss (padding; BOS targets; and with
  ``predict_first_token=False`` the positions of the document-opening token).
- ``segment_ids``: 1, 2, ... for each document piece in the row, 0 for padding. A new segment starts
  at every document-opening token (EOS, or BOS when configured) and at the row start.
- ``positions``: offset within the segment, restarting at 0 at each segment start, 0 for padding.

With ``document_masking=False`` a row is one segment (``segment_ids`` 1, ``positions`` 0..T-1), the
GPT-2 style of attending across documents. A finite loader completes its last batch with all-padding
rows (row index -1).
"""

from __future__ import annotations

import numpy as np

IGNORE = -1  # target value the loss ignores


def num_rows(num_tokens: int, seq_len: int) -> int:
    """Rows a stream of ``num_tokens`` packs into at ``seq_len``: ceil((num_tokens - 1) / seq_len)."""
    return max(0, -(-(num_tokens - 1) // seq_len))


def pack_windows(windows: np.ndarray, num_valid: np.ndarray, eos_id: int, *,
                 bos_id: int | None = None, document_masking: bool = True,
                 predict_first_token: bool = True) -> dict[str, np.ndarray]:
    """Rows from ``windows``: ``[b, T+1]`` ids of which row ``r`` uses the first ``num_valid[r] + 1``.

    ``num_valid [b]`` counts a row's real positions (``T`` for a full row, fewer for the padded last
    row, 0 for an all-padding row). Returns ``inputs``, ``targets``, ``segment_ids``, ``positions``,
    each ``[b, T] int32``. Vectorised over the batch: no per-row Python work. Documents open with
    ``bos_id`` when given (and BOS targets are ignored: BOS always follows EOS), else with EOS.
    """
    windows = np.asarray(windows, dtype=np.int32)
    b, t = windows.shape[0], windows.shape[1] - 1
    idx = np.arange(t, dtype=np.int32)
    valid = idx[None, :] < np.asarray(num_valid)[:, None]
    inputs = np.where(valid, windows[:, :-1], eos_id).astype(np.int32)
    targets = np.where(valid, windows[:, 1:], IGNORE).astype(np.int32)
    opens = (inputs == (eos_id if bos_id is None else bos_id)) & valid
    if document_masking:
        starts = opens.copy()
        starts[:, 0] = True
        segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
        positions = idx[None, :] - np.maximum.accumulate(np.where(starts, idx[None, :], 0), axis=1)
    else:
        segment_ids = np.ones((b, t), np.int32)
        positions = np.broadcast_to(idx, (b, t)).copy()
    segment_ids = np.where(valid, segment_ids, 0).astype(np.int32)
    positions = np.where(valid, positions, 0).astype(np.int32)
    if bos_id is not None:
        targets[targets == bos_id] = IGNORE
    if not predict_first_token:
        targets[opens] = IGNORE
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions}


def pack_window(window: np.ndarray, seq_len: int, eos_id: int, *, bos_id: int | None = None,
                document_masking: bool = True, predict_first_token: bool = True
                ) -> dict[str, np.ndarray]:
    """One row from ``window``: ``[n]`` ids with ``2 <= n <= seq_len + 1`` (shorter = last row, padded).

    Returns ``inputs``, ``targets``, ``segment_ids``, ``positions``, each ``[seq_len] int32``.
    """
    n = len(window) - 1
    padded = np.full((1, seq_len + 1), eos_id, np.int32)
    padded[0, :n + 1] = window
    row = pack_windows(padded, np.array([n]), eos_id, bos_id=bos_id, document_masking=document_masking,
                       predict_first_token=predict_first_token)
    return {k: v[0] for k, v in row.items()}


class PackedRows:
    """The packed rows of a token stream, read by row index, one at a time or a batch at a time.

    ``tokens`` is a 1-D integer array, usually a read-only ``np.memmap``: a row reads only its own
    ``seq_len + 1`` ids, so a host touches only the rows it loads.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: int, *, bos_id: int | None = None,
                 document_masking: bool = True, predict_first_token: bool = True):
        self.tokens = tokens
        self.seq_len = seq_len
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.document_masking = document_masking
        self.predict_first_token = predict_first_token
        self._len = num_rows(len(tokens), seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} out of range [0, {self._len})")
        return {k: v[0] for k, v in self.rows(np.array([i])).items()}

    def rows(self, row_ids: np.ndarray) -> dict[str, np.ndarray]:
        """``[b]`` row indices (-1 = an all-padding row) -> a dict of ``[b, seq_len] int32``."""
        row_ids = np.asarray(row_ids, dtype=np.int64)
        t, n = self.seq_len, len(self.tokens)
        starts = row_ids * t
        # Real positions per row: a target must exist, so position j needs token start + j + 1.
        num_valid = np.where(row_ids >= 0, np.clip(n - 1 - starts, 0, t), 0)
        if hasattr(self.tokens, "read_windows"):  # a token store: one batched read of the windows
            windows = self.tokens.read_windows(np.where(row_ids >= 0, starts, 0), t + 1)
        else:
            gather = np.minimum(starts[:, None] + np.arange(t + 1), n - 1)
            windows = np.asarray(self.tokens[np.where(row_ids[:, None] >= 0, gather, 0)])
        return pack_windows(windows, num_valid, self.eos_id, bos_id=self.bos_id,
                            document_masking=self.document_masking,
                            predict_first_token=self.predict_first_token)

    def __repr__(self) -> str:  # grain logs the source's repr; never print the token array
        return f"PackedRows(num_tokens={len(self.tokens)}, seq_len={self.seq_len}, rows={self._len})"
