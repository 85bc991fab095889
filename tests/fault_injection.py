"""``python tests/fault_injection.py <tieflax arguments>``: the tieflax console with one fault injected,
for tests of what other processes do when one process fails.

``TIEFLAX_TEST_FAIL_SAVE_ON_PROCESS=i``: on process ``i``, orbax's checkpoint write of step 5 fails with
ENOSPC (a full disk), as a real one would: raised from orbax's save.
"""

import errno
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inject() -> None:
    target = os.environ.get("TIEFLAX_TEST_FAIL_SAVE_ON_PROCESS")
    if target is None or os.environ.get("TIEFLAX_PROCESS_ID") != target:
        return
    import orbax.checkpoint as ocp

    original = ocp.CheckpointManager.save

    def failing_save(self, step, *args, **kwargs):
        if step == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{self.directory}/{step}")
        return original(self, step, *args, **kwargs)

    ocp.CheckpointManager.save = failing_save


if __name__ == "__main__":
    _inject()
    from tieflax.cli import main

    sys.exit(main(sys.argv[1:]))
