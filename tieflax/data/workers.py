"""Child processes that cannot outlive the command that started them (``tieflax prepare``'s tokenizer
workers, the BPE trainer).

A ``kill -9`` of the parent runs none of its clean-up, so a worker blocked on its task pipe would wait
forever, parented to init. Each child therefore asks the kernel to kill it when its parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux), and checks at once that the parent is still the one that
started it (it may have died before the request). Where prctl is missing (macOS), a thread in the child
polls its parent's pid instead.

``worker_pool`` is a ``ProcessPoolExecutor`` of such children that, when its block raises (an error in
one task, a signal, a bucket that stopped answering), cancels what is queued and kills the workers instead
of waiting for every task in flight to end.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a child: be killed when the process ``parent`` dies (or exit now if it has already)."""
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes  # noqa: PLC0415

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent:  # the parent died before the request: nobody would kill us later
        os._exit(1)
    if not armed:
        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, name="tieflax-parent-watch", daemon=True).start()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the system has one (a container's or a
    job's share, ``taskset``), else every core of the machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows: no affinity call
        return max(1, os.cpu_count() or 1)


def capped_workers(workers: int, *, say=None) -> int:
    """``workers``, at most one per usable core: a tokenizer process keeps one core busy, so more only
    share the cores and start in turn (1000 on 2 cores: 160 s where 1 takes 5 s). ``say`` gets one line
    when the count is lowered."""
    cores = usable_cores()
    if workers <= cores:
        return workers
    if say is not None:
        say(f"--workers {workers}: this process can use {cores} core{'s' if cores != 1 else ''}; using {cores} "
            "workers (one tokenizer process per core: more would only share them)")
    return cores


def _initialize(parent: int, initializer, initargs) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    if initializer is not None:
        initializer(*initargs)


def spawn_context():
    return multiprocessing.get_context("spawn")  # no fork after tensorstore's and rayon's threads


@contextlib.contextmanager
def worker_pool(workers: int, initializer=None, initargs=()):
    """A spawn ``ProcessPoolExecutor`` of ``workers`` processes that die with this one; on an exception
    in the block its queued tasks are cancelled and its processes killed (nothing waited for)."""
    pool = cf.ProcessPoolExecutor(workers, mp_context=spawn_context(), initializer=_initialize,
                                  initargs=(os.getpid(), initializer, tuple(initargs)))
    try:
        yield pool
    except BaseException:
        kill_pool(pool)
        raise
    pool.shutdown(wait=True)


def kill_pool(pool: cf.ProcessPoolExecutor) -> None:
    """Cancels the pool's queued tasks and kills its processes now."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for p in processes:
        with contextlib.suppress(Exception):
            p.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        with contextlib.suppress(Exception):
            p.join(timeout=5)


# ------------------------------------------------------------------------------------------ BPE trainer

_BATCH_CHARS = 1 << 20  # texts travel to the trainer in batches of about this much


def _train_bpe(texts, *, vocab_size: int, eos_token: str, min_frequency: int, length: int | None) -> str:
    """The trainer itself (in the child process; ``tieflax.data.tokenizer.train_bpe`` documents it): ->
    the tokenizer's JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=length)
    return tok.to_str()


def _bpe_main() -> None:
    """The trainer process: ``python -c ...`` (not multiprocessing's spawn, which would import the
    caller's ``__main__`` again: a script without a ``__main__`` guard would start itself over)."""
    import json  # noqa: PLC0415
    from multiprocessing.connection import Connection  # noqa: PLC0415

    parent, read_fd, write_fd, options = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        def texts():
            while True:
                batch = _receive(inbox)
                if batch is None:
                    return
                yield from batch

        _send(outbox, ("ok", _train_bpe(texts(), **options)))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
        with contextlib.suppress(Exception):
            _send(outbox, ("error", f"{type(e).__name__}: {e}"))


def _send(connection, obj) -> None:
    """``connection.send(obj)`` through ``bytes``. ``Connection.send`` pickles into a ``BytesIO`` and sends
    a memoryview of it: a signal handler's exception raised inside that call (Ctrl-C, SIGTERM) leaves the
    view in the traceback, and on Python 3.12 the garbage collector then frees the ``BytesIO`` first and
    the process dies of SIGSEGV ("deallocated BytesIO object has exported buffers") after its one line."""
    connection.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(connection):
    """The other end of :func:`_send` (``recv_bytes`` returns ``bytes``, no view of a ``BytesIO``)."""
    return pickle.loads(connection.recv_bytes())


def run_bpe_trainer(texts, **options) -> str:
    """Trains the byte-level BPE (:func:`_train_bpe`) on ``texts`` in a child process; -> the tokenizer's JSON.
    This process streams the texts and then waits in short polls, so a signal's handler runs at once; on
    any exception the child is killed."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    from multiprocessing.connection import Connection  # noqa: PLC0415

    from tieflax.data.config import DataError  # noqa: PLC0415

    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    # TIEFLAX_DATA_WORKER=1: the child skips importing grain and JAX (tieflax.data's docstring)
    child = subprocess.Popen(
        [sys.executable, "-c", "from tieflax.data.workers import _bpe_main; _bpe_main()", str(os.getpid()),
         str(to_child_r), str(from_child_w), json.dumps(options)],
        pass_fds=(to_child_r, from_child_w), env={**os.environ, "TIEFLAX_DATA_WORKER": "1"})
    os.close(to_child_r)
    os.close(from_child_w)
    outbox, inbox = Connection(to_child_w, readable=False), Connection(from_child_r, writable=False)

    def died() -> DataError:
        return DataError(f"the BPE trainer process died (exit status {child.poll()}) before it finished: check "
                         "the memory free on this machine, then rerun")
    try:
        try:
            batch, size = [], 0
            for text in texts:
                batch.append(text)
                size += len(text)
                if size >= _BATCH_CHARS:
                    _send(outbox, batch)
                    batch, size = [], 0
            _send(outbox, batch)
            _send(outbox, None)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the child stopped reading: its answer (an error) says why
        while not inbox.poll(0.2):
            if child.poll() is not None and not inbox.poll(0):
                raise died()
        try:
            kind, value = _receive(inbox)
        except EOFError:
            raise died() from None
        if kind != "ok":
            raise DataError(f"training the BPE tokenizer failed: {value}")
        return value
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=5)
        outbox.close()
        inbox.close()
