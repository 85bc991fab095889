"""TPU plans compile in a child process: libtpu ends a process it cannot compile for with SIGABRT (a C++
"Check failed"), which no Python handler can catch. The console reports the child's reason in one line
instead.

The console's own process imports no JAX, so the child costs about 0.2 s from a shell (tiny on v5e:2x2:
6.7 s either way); ``TIEFLAX_PLAN_IN_PROCESS=1`` compiles in this process, which saves about 3 s where JAX
is imported already (a test, a notebook calling ``cli.main``), and an abort then ends that process.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading

from tieflax.hardware import targets

DID_NOT_COMPILE_CODE = 1   # libtpu aborted the compile (the plan "did not compile")
IN_PROCESS_ENV = "TIEFLAX_PLAN_IN_PROCESS"
CHILD = "child"   # the value the console gives its child


def compiles_in_child(topology: str) -> bool:
    """Whether the plan of a canonical ``topology`` compiles in a child: TPU slices, unless
    ``TIEFLAX_PLAN_IN_PROCESS`` says otherwise (or this is the child)."""
    return targets.is_tpu(topology) and os.environ.get(IN_PROCESS_ENV, "") in ("", "0")


def is_child() -> bool:
    return os.environ.get(IN_PROCESS_ENV) == CHILD


# Lines of native (C++) logging: glog's "F1203 07:42:51.210989 24885 target.cc:1735] Check failed: ...",
# its stack traces and libtpu's start-up warnings. Held back from the live output; shown with --debug.
_NATIVE = re.compile(r"^([IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|\s*@\s|\*\*\* |=== |https://symbolize\.|"
                     r"WARNING: Logging before InitGoogle|Failed to find host bounds|learning/|\S+\.cc:\d+\s*$)")
_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] (.*)")


def plan_in_child(argv: list[str], topology: str, debug: bool = False) -> int:
    """Runs ``argv`` (the same ``tieflax plan``, for the canonical ``topology``) in a child process, passing
    its output through; a child ended by a signal (libtpu's abort) becomes one line naming the signal and
    libtpu's reason, and exit code 1 (did not compile)."""
    env = dict(os.environ, **{IN_PROCESS_ENV: CHILD})
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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
    debug = debug or os.environ.get("TIEFLAX_DEBUG", "") not in ("", "0", "false", "False")
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


def no_core_file() -> None:
    """In the child: an abort leaves no core file (the console reports it in one line)."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ValueError, OSError):
        pass
