"""launch/tpu_pod.sh against a fake ``gcloud`` on PATH (tests/pod_support.py) that records its calls, copies ``scp``
files into each fake host's folder and runs each ``ssh --worker=all`` command locally as one process per host. A
host starts in its own home folder (HOME = the host's folder, TIEFLAX_HOST_INDEX = its index), as a TPU VM's ssh
does, and imports the code the launcher copied there (``pip install`` is recorded, not run: the copy is put on
PYTHONPATH, which is what an editable install gives). The README's pod examples run as written: the same
arguments, with only sizes shrunk to a CPU and the buckets replaced by local folders."""

from __future__ import annotations

import os
import shlex
import subprocess
import time

from pod_support import LAUNCHER, fake_pod, launch_pod
from train_support import suite_xla_flags


def _calls(env) -> list[list[str]]:
    with open(os.path.join(env["FAKE_ROOT"], "calls")) as f:
        return [shlex.split(line) for line in f if line.strip()]


def test_dry_run_prints_every_gcloud_command_and_runs_none(tmp_path):
    env = fake_pod(tmp_path, 2)
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


# A cap on a wait for both hosts' logs to end, not a measure: on a 2-core machine under a load of 10+ the
# two-process runs below take minutes; the test fails at the cap only if a host never ends.
HOSTS_END_CAP_S = 1200


def _wait_for_logs(paths, cap_s=HOSTS_END_CAP_S) -> list[str]:
    """Waits until every log (host i's) ends with its `tieflax-pod: host i exit N` line; -> their texts."""
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline and not all(
            os.path.exists(p) and "tieflax-pod: host" in open(p).read() for p in paths):
        time.sleep(0.5)
    return [open(p).read() if os.path.exists(p) else "" for p in paths]


def test_help_exits_0_and_prints_the_usage(tmp_path):
    proc = launch_pod(fake_pod(tmp_path, 1), "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# Run any tieflax command") and "--attach" in proc.stdout, proc.stdout
    assert "set -euo" not in proc.stdout


def test_launcher_arguments_are_data_a_bad_one_is_one_line_and_nothing_runs(tmp_path):
    """A tag is a file name on every host and a value inside the remote command: a space or a `;` is
    refused (it broke the detached command, or ran a command of its own); a missing value is one line,
    not bash's "$2: unbound variable"; a user's `prepare --shard` on every host is refused, not replaced."""
    env = fake_pod(tmp_path, 2)
    cases = {
        ("--tag", "study 1", "tpu1", "zone1", "--", "compare", "--config", "c.py"): "--tag 'study 1': use letters",
        ("--tag", "x;touch INJECTED", "tpu1", "zone1", "--", "train"): "--tag 'x;touch INJECTED': use letters",
        ("--extras", "tpu] && touch INJECTED #", "tpu1", "zone1", "--", "train"): "--extras",
        ("--worker", "0;1", "tpu1", "zone1", "--", "train"): "--worker '0;1': give a worker number or all",
        ("--tag",): "--tag needs a value (see --help)",
        ("tpu1", "zone1", "--logs"): "put -- before the tieflax command",
        ("--logs", "--tag", "t", "tpu1", "zone1", "--", "train"): "--logs needs a value",
        ("tpu1", "zone1", "--", "prepare", "--config", "c.py", "--out", "o", "--shard", "1/2"):
            "prepare --shard: the launcher gives each host its own --shard i/N",
        ("tpu1",): "give TPU_NAME ZONE [PROJECT] -- COMMAND ARGS...",
    }
    for args, line in cases.items():
        proc = launch_pod(env, *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and line in proc.stderr, (args, proc.stderr)
        assert "unbound variable" not in proc.stderr
    assert not os.path.exists(os.path.join(env["FAKE_ROOT"], "calls"))  # nothing reached gcloud
    assert not list(tmp_path.rglob("INJECTED"))


def test_a_users_shard_on_one_worker_is_kept_and_paths_arrive_as_typed(tmp_path):
    """`--worker 1 -- prepare --shard 1/2` runs that share as given (no second --shard appended); an
    argument with spaces and quotes reaches the host as one word."""
    env = fake_pod(tmp_path, 2)
    proc = launch_pod(env, "--dry-run", "--no-install", "--worker", "1", "--tag", "one", "tpu1", "zone1", "--",
                      "prepare", "--config", "my configs/it's.py", "--out", "o", "--shard", "1/2")
    assert proc.returncode == 0, proc.stderr
    ssh = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("gcloud ")][-1]
    remote = next(a for a in ssh if a.startswith("--command=")).removeprefix("--command=")
    job = shlex.split(shlex.split(remote.split("nohup bash -c ", 1)[1])[0].split("tieflax prepare ", 1)[1])
    assert job[:6] == ["--config", "my configs/it's.py", "--out", "o", "--shard", "1/2"], job
    assert job.count("--shard") == 1, job


def test_a_host_where_the_command_cannot_start_says_so_and_the_launcher_exits_1(tmp_path):
    """No `tieflax` on a host's PATH (say `--no-install` on fresh hosts): each host says so in one line and
    the launcher exits 1, instead of "started on 2 host(s)" while nothing runs."""
    env = {**fake_pod(tmp_path, 2), "FAKE_HOST_PATH": "/usr/bin:/bin"}
    proc = launch_pod(env, "--no-install", "--tag", "t", "tpu1", "zone1", "--", "train", "--workdir", "w")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "started on" not in proc.stdout + proc.stderr
    for i in range(2):
        assert f"tieflax-pod: host {i}: no tieflax command on PATH (install it: drop --no-install)" in proc.stderr
    assert "train did not start on every host" in proc.stderr, proc.stderr


def _corpus(tmp_path):
    from tieflax.data import default_data_config
    from tieflax.data.sources import load_documents

    c = default_data_config()
    c.source = "python_stdlib"
    c.python_stdlib.max_files = 12
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, d in enumerate(load_documents(c)):
        (corpus / f"{i:03d}.txt").write_text(d.text[:3000])
    return corpus


# Sizes for a CPU, the only arguments the README's pod examples get beyond their own.
TINY_MODEL = ["model.vocab_size=300", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
              "model.n_kv_heads=1", "model.head_dim=16", "model.d_ff=64", "model.max_seq_len=16",
              "model.dtype='float32'", "model.mlp_chunk=0", "model.rope_scaling_factor=0.0"]
TINY_TRAIN = ["train.seq_len=16", "train.global_batch_size=8", "train.num_steps=2", "train.warmup_steps=1",
              "train.eval_every=2", "train.eval_batches=1", "train.log_every=1", "train.checkpoint_every=2"]


def test_readme_pod_examples_prepare_each_hosts_share_finalize_then_train_from_the_store(tmp_path):
    """The README's pod flow, from hosts that start in their home folders: `prepare` installs the code
    (copied to ~/tieflax-src on each host) and runs each host's `--shard i/N` with the README's relative
    `--config configs/experiments/tie_vs_untie.py`; `--no-install --attach --worker 0 ... --finalize` writes
    the manifest; then the README's train example (`-- --config configs/models/llama3_8b.py ...
    --config.data.source=tokens --config.data.tokens.path=STORE`) runs as one 2-process job."""
    from tieflax.data import store as st
    from train_support import free_port

    corpus, store = _corpus(tmp_path), tmp_path / "stores" / "corpus"
    env = fake_pod(tmp_path, 2)
    data = ["--config.data.source=files", f"--config.data.files.paths={corpus}/*.txt",
            "--config.data.tokenizer.vocab_size=300", "--config.model.vocab_size=300",
            "--config.data.val_fraction=0.3", "--shard-mb=0.004"]
    t0 = time.monotonic()
    proc = launch_pod(env, "--tag", "corpus", "my-v5p-64", "us-east5-a", "my-project", "--", "prepare",
                      "--config", "configs/experiments/tie_vs_untie.py", "--out", str(store), *data)
    returned = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "prepare started on 2 host(s), detached" in proc.stderr, proc.stderr
    pip = open(os.path.join(env["FAKE_ROOT"], "pip")).read()
    assert pip.count("install") == 2 and "tieflax-src\\[tpu\\]" in pip, pip  # once per host, editable
    home = [os.path.join(env["FAKE_ROOT"], f"host{i}") for i in range(2)]
    texts = _wait_for_logs([os.path.join(h, "tieflax-logs", "corpus.log") for h in home])
    assert all(f"tieflax-pod: host {i} exit 0" in t for i, t in enumerate(texts)), texts
    print(f"launcher returned after {returned:.1f} s; both hosts' shards done")
    assert not (store / "manifest.json").exists()  # shares only
    ssh = [c for c in _calls(env) if c[3] == "ssh"]
    assert len(ssh) == 2 and all("--worker=all" in c for c in ssh)
    proc = launch_pod(env, "--no-install", "--attach", "--worker", "0", "my-v5p-64", "us-east5-a", "my-project",
                      "--", "prepare", "--config", "configs/experiments/tie_vs_untie.py", "--out", str(store),
                      "--finalize", timeout=HOSTS_END_CAP_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert st.read_manifest(str(store))["input_shards"] >= 2

    env["FAKE_COORDINATOR"] = f"localhost:{free_port()}"
    env["XLA_FLAGS"] = suite_xla_flags(1)  # a 2-device mesh, one per host
    run = tmp_path / "runs" / "llama3_8b_untied"
    proc = launch_pod(env, "--no-install", "--tag", "train1", "my-v5p-64", "us-east5-a", "my-project", "--",
                      "--config", "configs/models/llama3_8b.py", "--workdir", str(run),
                      "--config.data.source=tokens", f"--config.data.tokens.path={store}",
                      *[f"--config.{o}" for o in TINY_MODEL + TINY_TRAIN])
    assert proc.returncode == 0, proc.stderr
    assert "train started on 2 host(s), detached" in proc.stderr, proc.stderr
    texts = _wait_for_logs([os.path.join(h, "tieflax-logs", "train1.log") for h in home])
    assert all(f"tieflax-pod: host {i} exit 0" in t for i, t in enumerate(texts)), texts
    assert (run / "checkpoints" / "2").is_dir(), texts


def test_readme_pod_example_compare_runs_detached_as_one_two_process_job_with_its_logs_copied(tmp_path):
    """The README's `--logs gs://my-bucket/logs --tag study1 ... -- compare --config
    configs/experiments/tie_vs_untie_pod.py --workdir ...` on 2 fake hosts starting in their home folders
    (the code installed by the launcher): one 2-process job (gloo) whose study is written once, by process 0;
    each host's log ends with its exit status and is copied to --logs (here a local folder)."""
    import json

    from task_support import WORDS
    from tieflax.study.report import REPORT, SUMMARY
    import numpy as np

    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 10)) + "." for _ in range(8)))
    from train_support import free_port

    env = {**fake_pod(tmp_path, 2), "FAKE_COORDINATOR": f"localhost:{free_port()}",
           "XLA_FLAGS": suite_xla_flags(1)}  # a 2-device mesh, one per host
    study, logs = tmp_path / "study", tmp_path / "logs"
    overrides = [
        "data.source=files", "data.tokens.dtype=''", f"data.files.paths={corpus}/*.txt",
        "data.tokenizer.vocab_size=300", "data.tokenizer.eos_token='<|endoftext|>'", "data.val_fraction=0.25", "mesh.fsdp=1", "mesh.tensor=1",
        *TINY_MODEL, "model.remat='none'", *TINY_TRAIN, "train.analyze_every=2", "train.checkpoint_every=2",
        "compare.analysis_points=1", "compare.val_batches=1", "compare.max_rows=64", "compare.seeds=(0,)",
        "compare.grad_batches=1", "compare.bootstrap=50", "compare.n_bins=2",
        "compare.variants=('tied', 'untied')"]
    t0 = time.monotonic()
    proc = launch_pod(env, "--logs", str(logs), "--tag", "study1", "my-v5p-64", "us-east5-a", "my-project", "--",
                      "compare", "--config", "configs/experiments/tie_vs_untie_pod.py", "--workdir", str(study),
                      *[f"--config.{o}" for o in overrides])
    assert proc.returncode == 0, proc.stderr
    assert "compare started on 2 host(s), detached" in proc.stderr, proc.stderr
    copies = [str(logs / "study1" / f"host{i}.log") for i in range(2)]
    _wait_for_logs(copies)
    took = time.monotonic() - t0
    logs_on_hosts = [os.path.join(env["FAKE_ROOT"], f"host{i}", "tieflax-logs", "study1.log") for i in range(2)]
    texts = [open(p).read() for p in logs_on_hosts]
    assert all(f"tieflax-pod: host {i} exit 0" in t for i, t in enumerate(texts)), texts
    assert [open(p).read() for p in copies] == texts  # the final copy is the whole log
    print(f"both hosts done and their logs copied {took:.1f} s after the launch")
    assert "report:" in texts[0] and "report:" not in texts[1], texts  # process 0 writes the study, once
    assert (study / REPORT).is_file()
    summary = json.loads((study / SUMMARY).read_text())
    assert [(r["variant"], r["seed"]) for r in summary["runs"]] == [("tied", 0), ("untied", 0)]
    for variant in ("tied", "untied"):
        # each checkpoint's data iterator state: one file per process, named with the process count
        states = sorted(p.name for p in (study / variant / "seed_0" / "checkpoints").glob("*/*/process_*.json"))
        assert states and set(states) == {"process_0-of-2.json", "process_1-of-2.json"}, states
