"""The ``tieflax`` console: one subcommand per module in ``tieflax/commands/``.

Each command module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Command modules keep heavy imports (orbax, grain, torch) inside ``run`` so that building the parser, and
light commands such as ``tieflax params``, stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import gc
import importlib
import importlib.util
import json
import os
import re
import sys

from tieflax import errors

# name -> module; order is the order of `tieflax --help`.
COMMANDS = {
    "params": "tieflax.commands.params",
    "train": "tieflax.commands.train",
    "val-loss": "tieflax.commands.val_loss",
    "compare": "tieflax.commands.compare",
    "analyze": "tieflax.commands.analyze",
    "sweep": "tieflax.commands.sweep",
    "convert": "tieflax.commands.convert",
    "plan": "tieflax.commands.plan",
    "evaluate": "tieflax.commands.evaluate", "sample": "tieflax.commands.sample",
    "prepare": "tieflax.commands.prepare",
}

# Old name -> new name: the old one still works for a release and says the new one on stderr.
RENAMED = {"eval": "val-loss"}
DEBUG_HELP = "show the full traceback of a failure (also: TIEFLAX_DEBUG=1)"
# One example of the --config.FIELD=VALUE overrides per command that takes them (shown by its --help); the
# others read a run's own config.json and say so.
OVERRIDE_EXAMPLES = {
    "params": "--config.model.tie_embeddings=False", "train": "--config.train.num_steps=100",
    "val-loss": "--config.train.eval_batches=4",
    "compare": "--config.train.num_steps=100", "sweep": "--config.train.num_steps=50",
    "convert": "--config.train.learning_rate=3e-4", "plan": "--config.train.seq_len=8192",
    "prepare": "--config.data.tokenizer.vocab_size=16384",
}


def overrides_help(command: str) -> str:
    """The epilog of ``command``'s --help: how it takes config overrides, with one example."""
    example = OVERRIDE_EXAMPLES.get(command)
    if example is None:
        return "--config.FIELD=VALUE overrides do not apply: this command reads the run's own config.json."
    return f"Set any config field with --config.FIELD=VALUE (as many as needed), e.g. {example}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tieflax", description="Tied vs untied embeddings in JAX/Flax LMs.",
        epilog="Config fields are set after a command with --config.FIELD=VALUE, e.g. tieflax train --config "
               "configs/experiments/tiny.py --workdir runs/tiny --config.train.num_steps=100")
    parser.add_argument("--debug", action="store_true", default=False, help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue  # a command whose module is not installed in this build
        module = importlib.import_module(module_name)
        aliases = [old for old, new in RENAMED.items() if new == name]
        command_parser = sub.add_parser(name, aliases=aliases, help=module.HELP,   # HELP: once, there
                                        description=module.HELP, epilog=overrides_help(name))
        command_parser.set_defaults(_module=module_name)
        command_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        module.add_arguments(command_parser)
    return parser


# CPython's cyclic collector runs after every 700 net allocations of container objects by default. Tracing
# and lowering a JAX program allocates millions of short-lived ones (tracers, equations, attribute dicts),
# so the collector ran thousands of times per program, each pass walking the young objects: about a tenth
# of a small training run's CPU time (a 20-step run on a CPU: 3.9 -> 3.5 CPU-s). Fewer, larger passes
# collect the same cycles; the process's memory grows by at most the garbage of one larger pass.
COLLECTOR_THRESHOLDS = (50_000, 20, 100)


def _stacks_on_a_crash() -> None:
    """A crash in native code (XLA, the profiler, TensorStore, a tokenizer) ends the process with a signal and
    no Python traceback; with the fault handler the process first writes every thread's Python stack to
    stderr ("Fatal Python error: Segmentation fault ... Current thread ..."), which names what was running.
    Left as it is where a caller already enabled it (pytest does) or where stderr is not a file (captured)."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(file=sys.stderr)
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is both OSError and ValueError
        pass


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv``; ``--config.a.b=value`` arguments anywhere become ``args.overrides``."""
    from tieflax.hardware.process import prepare_process  # noqa: PLC0415

    gc.set_threshold(*COLLECTOR_THRESHOLDS)
    _stacks_on_a_crash()

    args, module, debug = argparse.Namespace(command=None), None, False
    try:
        # From the first import on: a signal while the parser imports the commands, or a command its
        # libraries, is one line too (not KeyboardInterrupt's traceback out of an extension's import).
        with _signals_as_exceptions():
            # Before any command touches JAX: no libtpu start-up noise without a TPU; the chosen GPU flags.
            prepare_process()
            parser = build_parser()
            args, unknown = parser.parse_known_args(argv)
            args.overrides = list(getattr(args, "overrides", None) or []) + split_overrides(parser, args, unknown)
            debug = args.debug or os.environ.get("TIEFLAX_DEBUG", "") not in ("", "0", "false", "False")
            check_settings()
            if args.command in RENAMED:
                print(renamed_line(args.command), file=sys.stderr, flush=True)
            module = importlib.import_module(args._module)
            return int(module.run(args) or 0)
    except GeneratorExit:
        raise
    except BaseException as e:  # noqa: BLE001 (known failures become one line; the rest propagate)
        prefix = f"tieflax {args.command}" if args.command else "tieflax"
        stop = _interrupted_in(e)
        if stop is not None:  # SIGTERM/SIGINT outside the trainer's own handling: one line, locks released
            print(f"{prefix}: {interrupted_line(stop, module)}", file=sys.stderr, flush=True)
            return stop.code
        line = None if debug else one_line(e, full_disk=getattr(module, "FULL_DISK_FIX", None))
        if line is None:
            raise
        # Messages raised as "tieflax convert --from-hf: ..." keep their detail without a doubled prefix.
        line = re.sub(rf"^tieflax {args.command}( [^:]*)?: ", lambda m: (m.group(1) or "").strip() + ": "
                      if m.group(1) else "", line)
        print(f"{prefix}: {line}", file=sys.stderr, flush=True)
        if isinstance(e, (SystemExit, BadSetting)):
            return 2
        # A command may give bad input its own code (plan: 1 means "does not fit", so bad input is 2).
        return int(getattr(module, "USER_ERROR_CODE", 1))


def split_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> list[str]:
    """The ``--config.FIELD=VALUE`` overrides among the arguments argparse did not know; anything else is
    refused as an unrecognized argument. An override whose value follows a space
    (``--config.model.tie_embeddings False``) is refused under the command's own usage, naming the ``=`` it
    needs: argparse would call the value an unrecognized argument under the top-level usage."""
    overrides = [a for a in unknown if a.startswith("--config.")]
    rest = [a for a in unknown if not a.startswith("--config.")]
    for arg, after in zip(unknown, unknown[1:]):
        if arg.startswith("--config.") and "=" not in arg and not after.startswith("-"):
            _command_parser(parser, args).error(
                f"{arg} {after}: a config override takes its value after '=', not a space: {arg}={after}")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return overrides


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The subcommand's parser (its usage names the command's own arguments), or ``parser`` when none."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(args.command, parser)
    return parser


class BadSetting(errors.UserError):
    """An environment variable tieflax reads holds a value it cannot use: one line, exit 2 (as a bad
    argument: the command did not start)."""


def check_settings() -> None:
    """The environment settings a command may read, checked at its start, before any work: a bad value is
    one line naming the variable, the value and what it takes (BadSetting). Without this check,
    ``TIEFLAX_GPU_XLA_FLAGS`` failed as a traceback at ``import tieflax`` (``--help`` included), and a bad
    storage or checkpoint deadline at the first call that read it: for a local run, the second checkpoint,
    losing the steps trained since the first."""
    from tieflax import storage  # noqa: PLC0415 (light: neither imports JAX)
    from tieflax.hardware import gpu_flags  # noqa: PLC0415

    try:
        gpu_flags.choice()
        storage.check_deadline_settings()
    except errors.UserError as e:
        raise BadSetting(str(e)) from None


def renamed_line(old: str) -> str:
    """The one line an old command name prints before it runs under its new name."""
    return (f"tieflax {old}: renamed `tieflax {RENAMED[old]}`; `tieflax {old}` still works in this release "
            "and will be removed in a later one")


def _interrupted_in(e: BaseException) -> "Interrupted | None":
    """The :class:`Interrupted` that ``e`` is or was raised from (a signal during a C extension's import
    comes out as that import's ImportError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, Interrupted):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


# ------------------------------------------------------------------------------------------- signals
Interrupted = errors.Interrupted
# What a stop keeps, in the words of each command (``ON_INTERRUPT`` of its module may say otherwise):
# a trained step is kept by its checkpoint, a prepared shard by the store's ledger.
ON_INTERRUPT = "the workdir's lock is released and finished work is kept: rerun the same command to continue"


def interrupted_line(e: "Interrupted", module) -> str:
    """The one line a stop by a signal prints (after ``tieflax <command>: ``)."""
    if e.explained:
        return str(e)
    return f"stopped by {e.signal_name}; " + getattr(module, "ON_INTERRUPT", ON_INTERRUPT)


@contextlib.contextmanager
def _signals_as_exceptions():
    """SIGTERM and SIGINT raise :class:`Interrupted` for the block (in the main thread only). The trainer
    installs its own SIGTERM handler while it trains (finish the step, checkpoint, return 'preempted')
    and restores this one afterwards.

    A signal handler's exception is raised in whatever Python code runs at that moment; where that is a
    garbage-collector callback (JAX registers one), a weakref callback or a ``__del__``, Python prints
    it as "Exception ignored" and goes on. Such a swallowed :class:`Interrupted` reaches
    ``sys.unraisablehook`` instead, which re-arms the handler and sends the signal again from a helper
    thread, so that it lands in the command's own code a moment later."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum, frame):
        # Once: a second signal while the first unwinds must not cut the clean-up (lock, partial folder)
        # short; `kill -9` remains for a clean-up that hangs.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    def deliver_again(signum):
        if active.is_set():  # the block may have ended meanwhile: then the signal has nothing to stop
            os.kill(os.getpid(), signum)

    def redeliver_swallowed(unraisable):
        if not isinstance(unraisable.exc_value, Interrupted):
            previous_hook(unraisable)
            return
        for s in previous:  # undo raise_interrupted's "once" (a trainer's own SIGTERM handler stays)
            if signal.getsignal(s) == signal.SIG_IGN:
                signal.signal(s, raise_interrupted)
        timer = threading.Timer(0.05, deliver_again, (unraisable.exc_value.signum,))
        timer.daemon = True
        timer.start()

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    previous_hook = sys.unraisablehook
    active = threading.Event()
    active.set()
    for s in previous:
        signal.signal(s, raise_interrupted)
    sys.unraisablehook = redeliver_swallowed
    try:
        yield
    finally:
        active.clear()
        sys.unraisablehook = previous_hook
        for s, handler in previous.items():
            signal.signal(s, handler)


# ------------------------------------------------------------------------------------------ failures
# Modules whose exceptions are expected failures of the input (a damaged checkpoint or safetensors file,
# a full disk inside tensorstore), not bugs of tieflax: shown as one line without a traceback.
_LIBRARY_MODULES = ("orbax", "tensorstore", "safetensors", "grain", "tokenizers")
_OS_FIXES = {
    errno.ENOSPC: "free space on that disk, or write to another one",   # FULL_DISK_FIX: the command's words
    errno.EDQUOT: "free space on that disk, or write to another one",
    errno.ENOENT: "check the path",
    errno.EACCES: "check its permissions, or choose a folder you can write",
    errno.EPERM: "check its permissions, or choose a folder you can write",
    errno.EROFS: "choose a writable folder",
    errno.ENOTDIR: "a file stands where a folder is expected; choose another path",
    errno.EISDIR: "a folder stands where a file is expected; choose another path",
    errno.EEXIST: "it already exists; choose another path",
}


def one_line(e: BaseException, full_disk: str | None = None) -> str | None:
    """``<what> (<file or field>): <fix>`` for a failure of the input or the environment, or None for a
    failure that is a bug (whose traceback the user should see and report).

    The package's own user errors all derive from :class:`tieflax.errors.UserError`; OS errors and the
    libraries' errors about damaged input files are recognised here. ``full_disk``: the fix of a full disk
    in the words of the command (``FULL_DISK_FIX`` of its module: which flag names the folder)."""
    from tieflax.errors import UserError  # noqa: PLC0415

    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, str) else None
    if isinstance(e, UserError):
        return _flat(str(e))
    extra = isinstance(e, ModuleNotFoundError) and _EXTRAS.get((e.name or "").split(".")[0])
    if extra:
        return (f"this needs the optional package {e.name.split('.')[0]!r}, from tieflax's {extra!r} extra: "
                f"pip install 'tieflax[{extra}]' (or pip install -e '.[{extra}]' in a clone)")
    if isinstance(e, json.JSONDecodeError):
        return _flat(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; the file is damaged: restore "
                     "or delete it")
    if isinstance(e, OSError) and e.errno is not None:
        where = f" ({e.filename})" if e.filename else ""
        fix = (full_disk if full_disk and e.errno in (errno.ENOSPC, errno.EDQUOT)
               else _OS_FIXES.get(e.errno, "check the file and the disk"))
        return _flat(f"{e.strerror or e}{where}: {fix}")
    if isinstance(e, OSError):  # raised by tieflax with a message naming the file and the fix
        return _flat(str(e))
    if type(e).__module__.split(".")[0] in _LIBRARY_MODULES:
        return _flat(f"{type(e).__name__}: {e}") + " (run with --debug for the traceback)"
    return None


# The optional packages (setup.cfg's extras) by the name they are imported as: a command that needs one
# that is not installed says which extra to install, in one line.
_EXTRAS = {"lm_eval": "eval", "yaml": "eval", "jinja2": "eval", "torch": "hf", "transformers": "hf",
           "accelerate": "hf", "datasets": "data", "wandb": "wandb", "tensorboard": "tensorboard",
           "xprof": "tensorboard", "jupyter": "notebooks", "ipywidgets": "notebooks", "nbclient": "notebooks"}


def _flat(text: str, limit: int = 600) -> str:
    """One line: newlines folded, very long library messages (tensorstore specs) cut."""
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return text if len(text) <= limit else text[:limit] + " ..."


if __name__ == "__main__":
    sys.exit(main())
