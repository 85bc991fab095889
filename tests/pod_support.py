"""Helpers shared by the tests of launch/tpu_pod.sh (a helper module, not a test file): a fake ``gcloud`` on
PATH that records its calls, copies ``scp`` files into each fake host's folder and runs each ``ssh
--worker=all`` command locally as one process per host (``fake_pod``), and ``launch_pod``, which runs the
launcher against it.

Used by tests/test_pod_launcher.py and tests/test_script_arguments.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "launch", "tpu_pod.sh")

FAKE_GCLOUD = r"""#!/usr/bin/env bash
# records every call (one line, shell-quoted), answers describe, copies scp's file to every fake host,
# runs ssh --command on every fake host from its home folder
printf '%q ' "$@" >> "$FAKE_ROOT/calls"; echo >> "$FAKE_ROOT/calls"
worker=all; for a in "$@"; do case "$a" in --worker=*) worker="${a#--worker=}" ;; esac; done
hosts=(); for ((i = 0; i < FAKE_HOSTS; i++)); do
  [[ "$worker" == all || "$worker" == "$i" ]] && { hosts+=($i); mkdir -p "$FAKE_ROOT/host$i"; }
done
if [[ "$4" == describe ]]; then
  ips=(); for ((i = 0; i < FAKE_HOSTS; i++)); do ips+=("10.0.0.$i"); done
  (IFS=';'; echo "${ips[*]}"); exit 0
fi
if [[ "$1" == storage && "$2" == cp ]]; then  # gcloud storage cp [-q] SRC DST, DST a local folder here
  files=(); for a in "${@:3}"; do [[ "$a" == -* ]] || files+=("$a"); done
  mkdir -p "$(dirname "${files[1]}")" && cp "${files[0]}" "${files[1]}"; exit $?
fi
if [[ "$4" == scp ]]; then  # scp SRC TPU:DEST
  for i in "${hosts[@]}"; do cp "$5" "$FAKE_ROOT/host$i/${6#*:}" || exit 1; done; exit 0
fi
if [[ "$4" == ssh ]]; then
  cmd=""; for a in "$@"; do case "$a" in --command=*) cmd="${a#--command=}" ;; esac; done
  pids=()
  for i in "${hosts[@]}"; do
    home="$FAKE_ROOT/host$i"
    # FAKE_COORDINATOR: what a pod's metadata gives jax.distributed, as launch/local_multiprocess.sh does
    coord=(); [[ -z "${FAKE_COORDINATOR:-}" ]] || coord=(TIEFLAX_COORDINATOR="$FAKE_COORDINATOR"
                                                        TIEFLAX_NUM_PROCESSES="$FAKE_HOSTS" TIEFLAX_PROCESS_ID=$i)
    (cd "$home" && env HOME="$home" PATH="${FAKE_HOST_PATH:-$PATH}" PYTHONPATH="$(src="$home/tieflax-src"; [[ -d $src ]] && echo "$src" || echo "${PYTHONPATH:-}")" \
       TIEFLAX_HOST_INDEX=$i "${coord[@]}" bash -c "$cmd") &
    pids+=($!)
  done
  status=0; for p in "${pids[@]}"; do wait "$p" || status=$?; done; exit $status
fi
exit 0
"""
# python3 on the fake hosts: `python3 -m pip ...` is recorded, anything else runs this interpreter
FAKE_PYTHON3 = r"""#!/usr/bin/env bash
if [[ "$1" == -m && "$2" == pip ]]; then printf '%q ' "$@" >> "$FAKE_ROOT/pip"; echo >> "$FAKE_ROOT/pip"; exit 0; fi
exec {python} "$@"
"""


def fake_pod(tmp_path, hosts: int) -> dict:
    """A fake pod of ``hosts`` hosts under ``tmp_path`` (``bin/gcloud``, ``bin/python3`` and the hosts' folders
    under ``pod/``); -> the environment that puts it first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    (bin_dir / "python3").write_text(FAKE_PYTHON3.format(python=shlex.quote(sys.executable)))
    (bin_dir / "python3").chmod(0o755)
    root = tmp_path / "pod"
    root.mkdir()
    return {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
            "FAKE_ROOT": str(root), "FAKE_HOSTS": str(hosts), "JAX_PLATFORMS": "cpu"}


def launch_pod(env, *args, timeout=120) -> subprocess.CompletedProcess:
    """launch/tpu_pod.sh ``args`` in ``env`` (a ``fake_pod``'s), its output captured."""
    return subprocess.run([LAUNCHER, *args], env=env, capture_output=True, text=True, timeout=timeout)
