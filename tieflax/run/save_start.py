"""Multi-process: how each process's blocking start of a checkpoint save ended, learned by every process
through the coordinator's key-value store, within a deadline.

Why not a device collective right after the start: a process whose storage stops answering inside its
start never reaches it, and the others would wait there until JAX's heartbeat timeout (100 s), then crash
without a line. Why the start's watchdog asks the others before it exits: the processes that wait for
the stalled one at orbax's barrier inside their own start run out of time as well, and each would end
with a line of its own, blaming storage that answered it.

Each process posts one word under ``tieflax/save-start/<round>/<process>`` (a later word replaces it):

    ok:             its start returned
    failed:<line>   its start raised (the line says why)
    stalled:<line>  its watchdog ran out while its own storage work was unanswered
    waiting:        its watchdog ran out while it waited at orbax's barrier for another process

and reads the others' until they decide (``verdict``): all ``ok``, training goes on; otherwise every
process stops with the same line: the stalled processes' (naming them), else the first failed one's
(naming it), else, past the bound, one naming the processes that said nothing. Only when every process
stalled, or every one failed, is none named: the bucket itself, not one host.

While its start runs, each process also reads the others' words (``SaveStart.listening``): one that waits
at orbax's barrier for a process whose start failed or stalled stops at once with their line, instead of
when its own watchdog runs out (a refusal is answered at once; the storage deadline may be minutes).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
from typing import Callable

import jax

from tieflax import storage
from tieflax.hardware import distributed

OK, FAILED, STALLED, WAITING = "ok", "failed", "stalled", "waiting"
UNDECIDED = object()  # ``verdict``: not every word needed is there yet
_POLL_S = 0.05
# How often a process reads the others' words while its own start runs (``SaveStart.listening``): a start
# lasts well under a second when nothing fails, so this is a few reads per save.
_LISTEN_S = 0.25
_ROUNDS = itertools.count(1)  # every process starts the same saves in the same order: the same keys


def verdict(words: dict[int, tuple[str, str]], count: int, *, final: bool, silent: Callable[[list[int]], str]):
    """The line every process stops with, None to go on, or UNDECIDED (words still missing, before the
    bound: ``final`` False). ``words``: process -> (word, line); ``silent``: the line naming the processes
    that said nothing by the bound (or only that they wait)."""
    said_all = len(words) == count
    stalled = sorted(p for p, (word, _) in words.items() if word == STALLED)
    if stalled and (said_all or final):
        text = words[stalled[0]][1]
        if len(stalled) == count:  # every process's storage stopped: the bucket itself
            return text
        return f"process{'es' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))}: {text}"
    failed = sorted(p for p, (word, _) in words.items() if word == FAILED)
    if failed and (said_all or final):
        # Named as a stalled process is, process 0 included: a write refused on one host (its account, its
        # network) is that host's to fix, and the others print the same line with storage that answered them.
        text = words[failed[0]][1]
        return text if len(failed) == count else f"process {failed[0]}: {text}"
    if said_all and all(word == OK for word, _ in words.values()):
        return None
    if not final:
        return UNDECIDED
    return silent([p for p in range(count) if words.get(p, (WAITING, ""))[0] == WAITING])


def waits_at_orbax_barrier(thread_id: int) -> bool:
    """True when that thread is inside orbax's barrier (``sync_global_processes``): it waits there for
    another process, not for its own storage."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "sync_global_processes" and f"{os.sep}orbax{os.sep}" in code.co_filename:
            return True
        frame = frame.f_back
    return False


class SaveStart:
    """This process's start of one save in a multi-process job: its word to the others, and theirs.
    Made on the thread that runs the start, before it; ``bound_s``: how long this process waits for the
    others' words once its own start has ended (returned, raised, or run out). Counted from then, not from
    the start's beginning: the wait for the previous save that comes first may take any time up to the
    checkpoint deadline, and a peer that was not given the bound would be named silent."""

    def __init__(self, step: int, where: str, bound_s: float, setting: str):
        self.step, self.where, self.bound_s, self.setting = step, where, bound_s, setting
        self.key = f"tieflax/save-start/{next(_ROUNDS)}"
        self.me, self.count = jax.process_index(), jax.process_count()
        self.thread = threading.get_ident()
        self._lock = threading.Lock()
        self._stopping = False  # the watchdog's thread ends the process: the start's thread says nothing
        self._spoken = False  # the watchdog, or the listener, said this start's word before it ended
        self._mine: tuple[str, str] | None = None  # this process's word (known here if the coordinator is gone)

    def _say(self, word: str, line: str = "") -> None:
        self._mine = (word, line)
        with contextlib.suppress(Exception):  # the coordinator gone: the others find this process silent
            distributed.say(f"{self.key}/{self.me}", f"{word}:{line}")

    def _heard(self) -> dict[int, tuple[str, str]] | None:
        """The words posted so far; None when the coordinator no longer answers."""
        try:
            words = distributed.words_under(self.key)
        except Exception:  # noqa: BLE001 (the coordinator, process 0, is gone)
            return None
        return {p: tuple(value.split(":", 1)) if ":" in value else (value, "") for p, value in words.items()}

    def _silent_line(self, processes: list[int]) -> str:
        named = f"process{'es' if len(processes) > 1 else ''} {', '.join(map(str, processes))}"
        return (f"{named}: no word about the start of checkpoint {self.step} in {self.where} within "
                f"{self.bound_s:g} s (the host may have stopped or lost its network); check that host, then rerun "
                f"the command (work done so far is kept; {self.setting} sets the deadline)")

    def _decide(self, ended: threading.Event | None = None) -> str | None:
        """Reads the words until they decide (at the latest ``bound_s`` from now): the line to stop with, or
        None to go on; also None once ``ended`` is set (the start returned after all)."""
        words: dict[int, tuple[str, str]] = {}
        until = time.monotonic() + self.bound_s
        while True:
            if ended is not None and ended.is_set():
                return None
            heard = self._heard()
            words = {**(words if heard is None else heard), self.me: self._mine}
            final = heard is None or time.monotonic() >= until
            decided = verdict(words, self.count, final=final, silent=self._silent_line)
            if decided is not UNDECIDED:
                return decided
            time.sleep(_POLL_S)

    def ran_out(self, line: str, ended: threading.Event) -> None:
        """The start's watchdog ran out (its thread; ``line``: its own no-answer line). A process waiting
        at orbax's barrier waits on for the others' word, or its start's end; a stalled one says so. Then
        every process stops with the same line, process 0 last (it holds the coordinator)."""
        waiting = waits_at_orbax_barrier(self.thread)
        self._speak(WAITING if waiting else STALLED, "" if waiting else line, ended, waiting)

    @contextlib.contextmanager
    def listening(self):
        """The start's block, with a thread that reads the others' words while it runs (``_listen``)."""
        ended = threading.Event()
        threading.Thread(target=self._listen, args=(ended,), name="tieflax-save-start-listener", daemon=True).start()
        try:
            yield
        finally:
            ended.set()

    def _listen(self, ended: threading.Event) -> None:
        """Until the start ends: once another process said its start failed or stalled while this one waits
        at orbax's barrier, this one says it waits and stops with their line now. That process left the
        save, or is stopping: the barrier is never reached, and waiting for this start's watchdog would
        hold every process for the whole storage deadline (on a local disk, where no watchdog runs, for as
        long as orbax's barrier waits) after a refusal that was answered at once."""
        while not ended.wait(_LISTEN_S):
            heard = self._heard()
            if heard is None:  # the coordinator is gone: the watchdog ends this process
                return
            gave_up = any(word in (FAILED, STALLED) for p, (word, _) in heard.items() if p != self.me)
            if gave_up and waits_at_orbax_barrier(self.thread):
                self._speak(WAITING, "", ended, waiting=True)
                return

    def _speak(self, word: str, line: str, ended: threading.Event, waiting: bool) -> None:
        """Says this start's word before it ended (once: the watchdog's thread or the listener's), reads the
        others' until they decide (a waiting process: or until its start ends after all), then stops the
        process with the decided line, or returns when the start went on."""
        with self._lock:
            if self._spoken:
                return
            self._spoken = True
        self._say(word, line)
        decided = self._decide(ended if waiting else None)
        with self._lock:
            if decided is None or ended.is_set():  # the start went on: its thread agrees with the others
                return
            self._stopping = True
        storage.stop_at_once(decided, before_exit=distributed.leave_coordinator_last)

    def agree(self, refused: Exception | None) -> str | None:
        """The start returned (``refused``: or raised): says so and reads the others' words; the line every
        process stops with, or None to go on."""
        with self._lock:
            stopping = self._stopping
        if stopping:  # the watchdog's thread is printing the line and ending the process
            threading.Event().wait()
        self._say(OK if refused is None else FAILED, "" if refused is None else str(refused))
        return self._decide()
