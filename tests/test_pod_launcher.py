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
if [[ "$1" == storage && "$2" == cp ]]; then  # gcloud storage cp [-q] SRC DST, DST a local folder here
  files=(); for a in "${@:3}"; do [[ "$a" == -* ]] || files+=("$a"); done
  mkdir -p "$(dirname "${files[1]}")" && cp "${files[0]}" "${files[1]}"; exit $?
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
    # FAKE_COORDINATOR: what a pod's metadata gives jax.distributed, as launch/local_multiprocess.sh does
    coord=(); [[ -z "${FAKE_COORDINATOR:-}" ]] || coord=(TIEFLAX_COORDINATOR="$FAKE_COORDINATOR"
                                                        TIEFLAX_NUM_PROCESSES="$FAKE_HOSTS" TIEFLAX_PROCESS_ID=$i)
    (cd "$FAKE_ROOT/host$i" && env HOME="$FAKE_ROOT/host$i" TIEFLAX_HOST_INDEX=$i "${coord[@]}" bash -c "$cmd") &
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


def test_compare_runs_detached_as_one_two_process_job_with_its_logs_copied(tmp_path):
    """`compare` on 2 fake hosts: one 2-process job (gloo) whose study is written once, by process 0;
    each host's log ends with its exit status and is copied to --logs (here a local folder)."""
    import json

    from test_compare import CONFIG, WORDS
    from tieflax.study.report import REPORT, SUMMARY
    import numpy as np

    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 10)) + "." for _ in range(8)))
    from test_train_support import free_port

    env = {**_fake(tmp_path, 2), "FAKE_COORDINATOR": f"localhost:{free_port()}",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}  # a 2-device mesh, one per host
    study, logs = tmp_path / "study", tmp_path / "logs"
    overrides = [
        "data.source=files", f"data.files.paths={corpus}/*.txt", "data.tokenizer.vocab_size=300",
        "data.val_fraction=0.25", "model.vocab_size=300", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=16", "train.seq_len=16",
        "train.global_batch_size=8", "train.num_steps=2", "train.warmup_steps=1", "train.eval_every=2",
        "train.eval_batches=1", "train.log_every=1", "train.analyze_every=2", "compare.analysis_points=1",
        "compare.max_rows=64", "compare.seeds=(0,)", "compare.grad_batches=1", "compare.bootstrap=50",
        "compare.n_bins=2", "compare.variants=('tied', 'untied')"]
    t0 = time.monotonic()
    proc = subprocess.run([LAUNCHER, "--no-install", "--logs", str(logs), "--tag", "study", "tpu1", "zone1",
                           "--", "compare", "--config", CONFIG, "--workdir", str(study),
                           *[f"--config.{o}" for o in overrides]], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "compare started on 2 host(s), detached" in proc.stderr, proc.stderr
    copies = [logs / "study" / f"host{i}.log" for i in range(2)]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(p.exists() and "tieflax-pod: host" in p.read_text()
                                                  for p in copies):
        time.sleep(0.2)
    took = time.monotonic() - t0
    logs_on_hosts = [os.path.join(env["FAKE_ROOT"], f"host{i}", "tieflax-logs", "study.log") for i in range(2)]
    texts = [open(p).read() for p in logs_on_hosts]
    assert all(f"tieflax-pod: host {i} exit 0" in t for i, t in enumerate(texts)), texts
    assert [p.read_text() for p in copies] == texts  # the final copy is the whole log
    print(f"both hosts done and their logs copied {took:.1f} s after the launch")
    assert "report:" in texts[0] and "report:" not in texts[1], texts  # process 0 writes the study, once
    assert (study / REPORT).is_file()
    summary = json.loads((study / SUMMARY).read_text())
    assert [(r["variant"], r["seed"]) for r in summary["runs"]] == [("tied", 0), ("untied", 0)]
    for variant in ("tied", "untied"):
        # each checkpoint's data iterator state: one file per process, named with the process count
        states = sorted(p.name for p in (study / variant / "seed_0" / "checkpoints").glob("*/*/process_*.json"))
        assert states and set(states) == {"process_0-of-2.json", "process_1-of-2.json"}, states
