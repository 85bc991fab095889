"""Process 0's computations, told to the other processes: how lm-eval runs on a multi-process mesh.

lm-eval runs on process 0 only (it reads the tasks, builds the requests, scores the answers and writes
the files). Every batch it computes is a program on the run's whole mesh, which every process must run
with the same inputs, in the same order. So before each one process 0 sends it, numbered, through the
coordinator's key-value store (``jax.distributed``'s client, the store ``tieflax.hardware.distributed`` already
uses to agree on failures); the others wait for it, run the same program on their own devices' share,
and discard the (replicated) result. An evaluation ends with ``done`` (or ``failed`` and process 0's
error, which every process then raises). A message is a ``.npz`` of the batch's arrays (no pickle).

    channel = Channel()                      # every process, at the same point
    channel.send("score", tokens=t, ...)     # process 0, before computing
    kind, arrays = channel.receive()         # the others, in a loop
"""

from __future__ import annotations

import io
from typing import Optional

import numpy as np

_sessions = [0]
WAIT_MS = 24 * 3600 * 1000   # process 0 may spend long between two batches (lm-eval building a task)


class Channel:
    """One evaluation's messages from process 0; created by every process in the same order."""

    def __init__(self):
        from jax._src import distributed as jax_distributed  # noqa: PLC0415

        self.client = jax_distributed.global_state.client
        _sessions[0] += 1
        self.prefix = f"tieflax/eval/{_sessions[0]}"
        self.sent = self.received = 0

    def send(self, kind: str, **arrays: np.ndarray) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, __kind__=np.array(kind), **{k: np.asarray(v) for k, v in arrays.items()})
        self.sent += 1
        self.client.key_value_set_bytes(f"{self.prefix}/{self.sent}", buffer.getvalue())
        if self.sent > 2:   # every process has read message n - 2: it ran the program that message started
            self.client.key_value_delete(f"{self.prefix}/{self.sent - 2}")

    def receive(self) -> tuple[str, dict[str, np.ndarray]]:
        self.received += 1
        data = self.client.blocking_key_value_get_bytes(f"{self.prefix}/{self.received}", WAIT_MS)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        return str(arrays.pop("__kind__")), arrays

    def finish(self, error: Optional[str] = None) -> None:
        if error is None:
            self.send("done")
        else:
            self.send("failed", message=np.array(error))
