"""``tieflax plan``: per-device memory and compile time of a config's train and eval steps on a TPU pod,
GPU server or this machine, compiled here without the hardware. Exits 1 when it does not fit.

    tieflax plan --config configs/models/llama3_8b.py --topology v5p:4x4x4 --config.train.seq_len=8192
    tieflax plan --config configs/models/gemma_2b.py --topology v5e:4x4 --tie both --json
    tieflax plan --config configs/experiments/tiny.py --topology h100:8     # needs the gpu extra

The batch is one sequence per device unless ``--config.train.global_batch_size`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HELP = "per-device memory of a config's train step on a TPU pod or GPU server, compiled here"
USER_ERROR_CODE = 2  # exit codes: 0 fits, 1 does not fit, 2 bad input (config, topology, mesh, --xla-dump)
DID_NOT_COMPILE_CODE = 1   # libtpu aborted the compile (the plan "did not compile")
# TPU plans compile in a child process: libtpu ends a process it cannot compile for with SIGABRT (a C++
# "Check failed"), which no Python handler can catch. The console reports the child's reason in one line
# instead. The console's own process imports no JAX, so the child costs about 0.2 s from a shell (tiny on
# v5e:2x2: 6.7 s either way here); TIEFLAX_PLAN_IN_PROCESS=1 compiles in this process, which saves about 3 s
# where JAX is imported already (a test, a notebook calling cli.main), and an abort then ends that process.
IN_PROCESS_ENV = "TIEFLAX_PLAN_IN_PROCESS"
CHILD = "child"   # the value the console gives its child


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a config file, e.g. configs/models/llama3_8b.py")
    parser.add_argument("--topology", required=True,
                        help="v5e:2x4, v5p:4x4x4, v4:2x2x1, v6e:4x4 (TPU chip grids) or gcloud's names "
                             "(v5litepod-16, v5p-128, v6e-256, v4-64); h100:8, h100_pcie:8, h200:8, a100:8, "
                             "a100_40gb:8 (GPU); "
                             "cpu (this machine's devices)")
    parser.add_argument("--tie", default="config", choices=("config", "tied", "untied", "both"),
                        help="plan the config as is, forced tied or untied, or both side by side")
    parser.add_argument("--no-eval", action="store_true", help="compile the train step only")
    parser.add_argument("--xla-dump", default=None, help="keep XLA's dump (HLO, buffer assignment) here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    # Compile only: JAX must not claim an attached accelerator, and libtpu may be loaded by others too.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tieflax.hardware import targets  # noqa: PLC0415 (light: nothing of JAX is imported by it)

    try:   # the shape is checked here, before libtpu is loaded: it aborts the process on some
        topology, mapped = targets.canonical_topology(args.topology)
    except targets.TargetError as e:
        print(f"tieflax plan: {e}", file=sys.stderr)
        return USER_ERROR_CODE
    if mapped:
        print(f"tieflax plan: {mapped}", file=sys.stderr, flush=True)
    if targets.is_tpu(topology) and os.environ.get(IN_PROCESS_ENV, "") in ("", "0"):
        return _plan_in_child(args, topology)
    if os.environ.get(IN_PROCESS_ENV) == CHILD:
        _no_core_file()

    from tieflax import plan  # noqa: PLC0415
    from tieflax.config import load_config  # noqa: PLC0415

    config = load_config(args.config, args.overrides)
    batch_given = any(o.removeprefix("--").removeprefix("config.").startswith("train.global_batch_size=")
                      for o in args.overrides)
    try:
        target = targets.resolve(topology)
    except targets.TargetError as e:
        print(f"tieflax plan: {e}", file=sys.stderr)
        return USER_ERROR_CODE
    if args.xla_dump:
        _check_dump_dir(args.xla_dump)
    progress = None if args.json else (lambda text: print(text + " ...", file=sys.stderr, flush=True))
    name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
    plans = plan.plan_variants(config, target, tie=args.tie, name=name,
                               global_batch_size=config.train.global_batch_size if batch_given else None,
                               with_eval=not args.no_eval, dump_dir=args.xla_dump, progress=progress)
    if args.json:
        payload = [p.as_dict() for p in plans]
        print(json.dumps(payload if len(payload) > 1 else payload[0], indent=2))
    else:
        print(plan.format_report(plans))
    return 0 if all(p.fits for p in plans) else 1


def _check_dump_dir(folder: str) -> None:
    """Before compiling: XLA writes its dump with plain file calls and, when it cannot, logs an error per
    file and goes on (the largest-temporaries table, read from the dump, would be missing)."""
    from tieflax.plan import PlanError  # noqa: PLC0415

    if "://" in folder:
        raise PlanError(f"--xla-dump {folder}: XLA writes its dump to a local folder only; give a local path")
    probe = os.path.join(folder, f".tieflax-probe-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        raise PlanError(f"--xla-dump {folder} is not a writable folder ({e.strerror or e}): choose a folder "
                        "you can write, or leave --xla-dump out") from None


# ------------------------------------------------------------------------------------- the child process
# Lines of native (C++) logging: glog's "F1203 07:42:51.210989 24885 target.cc:1735] Check failed: ...",
# its stack traces and libtpu's start-up warnings. Held back from the live output; shown with --debug.
_NATIVE = re.compile(r"^([IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|\s*@\s|\*\*\* |=== |https://symbolize\.|"
                     r"WARNING: Logging before InitGoogle|Failed to find host bounds|learning/|\S+\.cc:\d+\s*$)")
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] (.*)")


def child_command(args: argparse.Namespace, topology: str) -> list[str]:
    """The command line of the child that compiles: this same ``tieflax plan``, for the canonical name."""
    argv = [sys.executable, "-m", "tieflax.cli", "plan", "--config", args.config, "--topology", topology,
            "--tie", args.tie]
    argv += ["--no-eval"] * bool(args.no_eval) + ["--json"] * bool(args.json)
    argv += ["--xla-dump", args.xla_dump] if args.xla_dump else []
    argv += ["--debug"] * bool(getattr(args, "debug", False))
    return argv + list(args.overrides)


def _plan_in_child(args: argparse.Namespace, topology: str) -> int:
    """Runs the plan in a child process, passing its output through; a child ended by a signal (libtpu's
    abort) becomes one line naming the signal and libtpu's reason, and exit code 1 (did not compile)."""
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import threading  # noqa: PLC0415

    env = dict(os.environ, **{IN_PROCESS_ENV: CHILD})
    child = subprocess.Popen(child_command(args, topology), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, text=True, errors="replace", bufsize=1,
                             start_new_session=True)   # a Ctrl-C reaches it once, forwarded from here
    held, last_step = [], []

    def out():
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    def err():
        for line in child.stderr:
            if _NATIVE.match(line):
                held.append(line)
                continue
            if line.startswith("compiling the "):
                last_step[:] = [line.rstrip().removesuffix(" ...")]
            sys.stderr.write(line)
            sys.stderr.flush()

    readers = [threading.Thread(target=f, daemon=True) for f in (out, err)]
    for r in readers:
        r.start()
    try:
        code = child.wait()
    except BaseException as e:   # SIGTERM / SIGINT (the console's Interrupted): the child stops the same way
        signum = getattr(e, "signum", signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
        if child.poll() is None:
            child.send_signal(signum)
        try:
            child.wait(timeout=30)
        except BaseException:  # noqa: BLE001
            child.kill()
            child.wait()
        for r in readers:
            r.join(timeout=5)
        if child.returncode >= 0:   # it stopped in its own console, which printed the one line
            return child.returncode
        raise
    for r in readers:
        r.join()
    debug = getattr(args, "debug", False) or os.environ.get("TIEFLAX_DEBUG", "") not in ("", "0", "false",
                                                                                        "False")
    if code >= 0:
        if held and debug:
            sys.stderr.writelines(held)
        return code
    if debug:
        sys.stderr.writelines(held)
    try:
        what = signal.Signals(-code).name
    except ValueError:
        what = f"signal {-code}"
    where = f" while {last_step[0]}" if last_step else ""
    print(f"tieflax plan: libtpu stopped the compile with {what}{where}: {child_reason(held)}; nothing was "
          f"planned for {topology} (the reason is libtpu's; --debug shows its log)", file=sys.stderr,
          flush=True)
    return DID_NOT_COMPILE_CODE


def child_reason(lines: list[str]) -> str:
    """libtpu's reason from a dead child's native log: its fatal line ("Check failed: ... (target.cc:1735)")
    or else the first "Check failed" / "Fatal" line; 'no reason given' when there is none."""
    for line in lines:
        m = _FATAL.match(line)
        if m:
            return f"{m.group(2).strip()} ({m.group(1)})"
    for line in lines:
        if "Check failed" in line or "Fatal" in line:
            return line.strip()[:300]
    return "no reason given"


def _no_core_file() -> None:
    """In the child: an abort leaves no core file (the console reports it in one line)."""
    import resource  # noqa: PLC0415

    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ValueError, OSError):
        pass
