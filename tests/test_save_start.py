"""How the processes of a job decide on the start of a save from each one's word (tieflax/run/save_start.py's
``verdict``; tests/test_stop_together.py runs it in a 2-process job whose process 0 stalls in its start)."""

from __future__ import annotations

from tieflax.run.save_start import FAILED, OK, STALLED, UNDECIDED, WAITING, verdict

LINE = "cannot save checkpoint 20 to gs://b/run/checkpoints: no answer from gs://b within 15 s"


def _silent(processes: list[int]) -> str:
    return f"silent {processes}"


def test_every_start_returned_goes_on():
    assert verdict({0: (OK, ""), 1: (OK, "")}, 2, final=False, silent=_silent) is None


def test_a_stalled_process_is_named_once_every_process_said_its_word():
    words = {0: (STALLED, LINE)}
    assert verdict(words, 2, final=False, silent=_silent) is UNDECIDED   # process 1 may have stalled too
    assert verdict({**words, 1: (WAITING, "")}, 2, final=False, silent=_silent) == f"process 0: {LINE}"
    assert verdict({**words, 1: (OK, "")}, 2, final=False, silent=_silent) == f"process 0: {LINE}"
    assert verdict(words, 2, final=True, silent=_silent) == f"process 0: {LINE}"


def test_stalled_processes_are_all_named_unless_every_process_stalled():
    three = {0: (WAITING, ""), 1: (STALLED, LINE), 2: (STALLED, LINE)}
    assert verdict(three, 3, final=False, silent=_silent) == f"processes 1, 2: {LINE}"
    assert verdict({0: (STALLED, LINE), 1: (STALLED, LINE)}, 2, final=False, silent=_silent) == LINE


def test_a_failed_start_is_named_process_0_included_unless_every_process_failed():
    assert verdict({0: (OK, ""), 1: (FAILED, "denied")}, 2, final=False, silent=_silent) == "process 1: denied"
    # Process 0's refused write is its host's (its account, its network), as its stall is: named.
    assert verdict({0: (FAILED, "denied"), 1: (WAITING, "")}, 2, final=False, silent=_silent) == "process 0: denied"
    assert verdict({0: (FAILED, "denied"), 1: (OK, "")}, 2, final=False, silent=_silent) == "process 0: denied"
    assert verdict({0: (FAILED, "denied")}, 2, final=False, silent=_silent) is UNDECIDED
    assert verdict({0: (FAILED, "denied")}, 2, final=True, silent=_silent) == "process 0: denied"
    assert verdict({0: (FAILED, "a"), 1: (FAILED, "b")}, 2, final=False, silent=_silent) == "a"  # the bucket's


def test_past_the_bound_the_processes_that_said_nothing_or_only_wait_are_named():
    assert verdict({0: (OK, "")}, 2, final=False, silent=_silent) is UNDECIDED
    assert verdict({0: (OK, "")}, 2, final=True, silent=_silent) == "silent [1]"
    assert verdict({0: (OK, ""), 1: (WAITING, "")}, 3, final=True, silent=_silent) == "silent [1, 2]"
