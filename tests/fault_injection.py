"""``python tests/fault_injection.py <tieflax arguments>``: the tieflax console with one fault injected,
for tests of what other processes do when one process fails.

``TIEFLAX_TEST_FAIL_SAVE_ON_PROCESS=i``: on process ``i``, the first checkpoint's array write fails with
ENOSPC (a full disk) in orbax's background save, where a real write failure surfaces; the other processes'
saves go on (and wait for process ``i`` at orbax's commit barrier).
"""

import errno
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inject() -> None:
    target = os.environ.get("TIEFLAX_TEST_FAIL_SAVE_ON_PROCESS")
    if target is None or os.environ.get("TIEFLAX_PROCESS_ID") != target:
        return
    from orbax.checkpoint._src.serialization import jax_array_handlers

    original = jax_array_handlers.ArrayHandler.serialize
    calls = []

    class FullDisk:
        """A commit future whose write failed: orbax's background save thread raises it."""

        def result(self, timeout=None):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "checkpoints/5/state (process shard)")

    async def failing_serialize(self, values, infos, args=None):
        futures = await original(self, values, infos, args)
        calls.append(1)
        # The parameters' arrays of the first save (step 5) fail as a full disk would, in the background.
        return list(futures) + [FullDisk()] if len(calls) == 1 else futures

    jax_array_handlers.ArrayHandler.serialize = failing_serialize


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is each thread?
    _inject()
    from tieflax.cli import main

    sys.exit(main(sys.argv[1:]))
