"""launch/tpu_pod.sh against a fake ``gcloud`` on PATH that records its calls and runs each ``ssh
--worker=all`` command locally as one process per host (HOME = the host's folder, TIEFLAX_HOST_INDEX = its
index), the contract of launch/local_multiprocess.sh."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO, "launch", "tpu_pod.sh")

FAKE_GCLOUD = r"""#!/usr/bin/env bash
# records every call (one line, shell-quoted), answers describe, runs ssh --command on every fake host
printf '%q ' "$@" >> "$FAKE_ROOT/calls"; echo >> "$FAKE_ROOT/calls"
if [[ "$4" == describe ]]; then
  ips=(); for ((i = 0; i < FAKE_HOSTS; i++)); do ips+=("10.0.0.$i"); done
  (IFS=';'; echo "${ips[*]}"); exit 0
fi
if [[ "$4" == ssh ]]; then
  cmd=""; worker=all
  for a in "$@"; do
    case "$a" in --command=*) cmd="${a#--command=}" ;; --worker=*) worker="${a#--worker=}" ;; esac
  done
  pids=()
  for ((i = 0; i < FAKE_HOSTS; i++)); do
    [[ "$worker" == all || "$worker" == "$i" ]] || continue
    mkdir -p "$FAKE_ROOT/host$i"
    (cd "$FAKE_ROOT/host$i" && HOME="$FAKE_ROOT/host$i" TIEFLAX_HOST_INDEX=$i bash -c "$cmd") &
    pids+=($!)
  done
  status=0; for p in "${pids[@]}"; do wait "$p" || status=$?; done; exit $status
fi
exit 0
"""


def _fake(tmp_path, hosts: int) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    root = tmp_path / "pod"
    root.mkdir()
    return {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
            "FAKE_ROOT": str(root), "FAKE_HOSTS": str(hosts), "JAX_PLATFORMS": "cpu"}


def _calls(env) -> list[list[str]]:
    with open(os.path.join(env["FAKE_ROOT"], "calls")) as f:
        return [shlex.split(line) for line in f if line.strip()]


def test_dry_run_prints_every_gcloud_command_and_runs_none(tmp_path):
    env = _fake(tmp_path, 2)
    proc = subprocess.run([LAUNCHER, "--dry-run", "--logs", "gs://b/logs", "--tag", "study1", "my-v5p-64",
                           "us-east5-a", "my-project", "--", "compare", "--config", "configs/experiments/tiny.py",
                           "--workdir", "gs://b/study"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert not os.path.exists(os.path.join(env["FAKE_ROOT"], "calls"))  # nothing ran
    gcloud = [shlex.split(line) for line in lines if line.startswith("gcloud ")]
    assert [c[4] for c in gcloud] == ["describe", "scp", "ssh", "ssh"], lines
    assert all("--zone" in c and "my-project" in c for c in gcloud)
    run = next(a for a in gcloud[-1] if a.startswith("--command="))
    assert "nohup bash -c" in run and "TIEFLAX_DISTRIBUTED=1" in run and "compare" in run, run
    assert "gs://b/logs/study1/host" in run.replace("\\", ""), run
    assert "pip install" in next(a for a in gcloud[2] if a.startswith("--command="))


def test_prepare_runs_detached_on_every_host_each_its_shard_then_finalize(tmp_path):
    from tieflax.data import default_data_config
    from tieflax.data import store as st
    from tieflax.data.sources import load_documents

    c = default_data_config()
    c.source = "python_stdlib"
    c.python_stdlib.max_files = 12
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, d in enumerate(load_documents(c)):
        (corpus / f"{i:03d}.txt").write_text(d.text[:3000])
    out = tmp_path / "store"
    env = _fake(tmp_path, 2)
    args = ["--config", os.path.join(REPO, "configs/experiments/tiny.py"), "--out", str(out),
            "--config.data.source=files", f"--config.data.files.paths={corpus}/*.txt",
            "--config.data.tokenizer.vocab_size=300", "--config.model.vocab_size=300",
            "--config.data.val_fraction=0.3", "--shard-mb=0.004"]
    t0 = time.monotonic()
    proc = subprocess.run([LAUNCHER, "--no-install", "--tag", "prep", "tpu1", "zone1", "--", "prepare", *args],
                          env=env, capture_output=True, text=True, timeout=60)
    returned = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "prepare started on 2 host(s), detached" in proc.stderr, proc.stderr
    logs = [os.path.join(env["FAKE_ROOT"], f"host{i}", "tieflax-logs", "prep.log") for i in range(2)]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(
            os.path.exists(p) and "tieflax-pod: host" in open(p).read() for p in logs):
        time.sleep(0.2)
    texts = [open(p).read() for p in logs]
    assert all(f"tieflax-pod: host {i} exit 0" in t for i, t in enumerate(texts)), texts
    print(f"launcher returned after {returned:.1f} s; both hosts' shards done")
    assert not (out / "manifest.json").exists()  # shares only
    ssh = [c for c in _calls(env) if c[3] == "ssh"]
    assert len(ssh) == 1 and "--worker=all" in ssh[0]
    proc = subprocess.run([LAUNCHER, "--no-install", "--attach", "--worker", "0", "--tag", "fin", "tpu1", "zone1",
                           "--", "prepare", *args, "--finalize"], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert st.read_manifest(str(out))["input_shards"] >= 2
