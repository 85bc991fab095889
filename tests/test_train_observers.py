"""Watching a run: a plain console line per log interval, W&B (offline) and TensorBoard as trackers, a
profiler window, lm-eval tasks scored during training on the live parameters; ``tieflax evaluate`` on 2
processes equal to 1 per sample.

One micro run does all of it at once: started as ``tieflax train`` with stdout in a file (as ``| cat`` or
a pod's log), killed with -9 once it has scored its tasks at step 10, then resumed in this process to the
end.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from console_support import capture_console, foreign_problems
from task_support import TASKS as EVAL_TASKS, write_tasks   # log-likelihood, generation, rolling
from train_support import REPO, micro_config, prepare_shared_data, start_train, subprocess_env, suite_xla_flags
from tieflax.run import checkpoints as ckpt
from tieflax.run.layout import METRICS_DIR
from tieflax.run.metrics import read_metrics
from tieflax.run.trackers import FLUSH_SECONDS

# lm-eval scores in this process: without its torch environment report (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("lm_eval_without_env_report")

N = 20
pytest.importorskip("wandb")
pytest.importorskip("lm_eval")


def _wandb_env(root) -> dict:
    """W&B offline, its caches and settings inside the test's folder (nothing in ~)."""
    return {"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(root / "wandb_config"),
            "WANDB_CACHE_DIR": str(root / "wandb_cache"), "WANDB_DATA_DIR": str(root / "wandb_data")}


def _config(data_dir, tasks):
    c = micro_config(data_dir, num_steps=N)
    t = c.train
    t.trackers = ("tensorboard", "wandb")
    t.wandb_group, t.wandb_tags = "observers", ("micro", "tied")
    t.profile_steps = (5, 7)
    t.eval_tasks, t.eval_tasks_every, t.eval_tasks_include_path = ("tf_mc",), 10, tasks
    return c


def _kill9_once_tasks_are_logged_at(step, workdir, proc, log, timeout=300):
    """kill -9 the run once it has logged its tasks at ``step``: stopped first (SIGSTOP: it cannot go
    on), then W&B's service, a separate process, is given its file-writing interval, then SIGKILL."""
    deadline = time.time() + timeout
    seen = None   # the metrics files' names and sizes: they are read again only when one changed (a listing
    while time.time() < deadline:   # every 10 ms costs little; reading and parsing every row each time did)
        try:
            now = sorted((e.name, e.stat().st_size) for e in os.scandir(os.path.join(workdir, METRICS_DIR)))
        except FileNotFoundError:
            now = None
        if now and now != seen:
            seen = now
            try:
                if any(r["step"] == step for r in read_metrics(workdir, "tasks")):
                    break
            except FileNotFoundError:
                pass
        assert proc.poll() is None, f"training exited early with {proc.returncode}:\n{open(log).read()[-20000:]}"
        time.sleep(0.01)
    else:
        raise AssertionError(f"no tasks logged at step {step} within {timeout}s")
    proc.send_signal(signal.SIGSTOP)
    time.sleep(2 * FLUSH_SECONDS + 0.5)
    proc.kill()
    proc.wait(timeout=60)
    return ckpt.latest_step(workdir)


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    root = tmp_path_factory.mktemp("observers")
    data_dir = str(root / "data")
    prepare_shared_data(data_dir)
    tasks = write_tasks(root / "tasks")
    config = _config(data_dir, tasks)
    workdir = str(root / "run")
    env = _wandb_env(root)
    first_log = str(root / "first.log")
    proc = start_train(workdir, config, log_path=first_log, **env)   # stdout is a file: console 'auto' -> lines
    killed_after = _kill9_once_tasks_are_logged_at(10, workdir, proc, first_log)
    first = open(first_log, encoding="utf-8", errors="replace").read()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        from tieflax.train import train_and_evaluate

        result, console = capture_console(train_and_evaluate, config, workdir)
    import wandb

    wandb.teardown()   # the W&B service this process started
    return dict(root=root, workdir=workdir, tasks=tasks, config=config, first=first, console=console,
                result=result, killed_after=killed_after)


def _interval_lines(text: str) -> dict[int, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("tieflax: step ") and f"/{N} | loss " in line:
            out[int(line.split()[2].split("/")[0])] = line
    return out


def test_console_is_one_plain_line_per_log_interval(watched):
    first, console = watched["first"], watched["console"]
    assert "\r" not in first, "carriage returns in a log file"
    lines = _interval_lines(first)
    assert 5 in lines and 10 in lines, first[-3000:]
    assert "(with compilation)" in lines[5]
    for field in ("| lr ", " s/step", " tokens/s/device", " TFLOP/s/device"):
        assert field in lines[10], lines[10]
    assert "MFU" not in lines[10] and "memory" not in lines[10]   # a CPU has neither a known peak nor memory stats
    assert "tieflax: checkpoint of step 5 saved: checkpoints/5" in first
    resumed = _interval_lines(console)
    assert f"tieflax: resuming from step {watched['killed_after']}" in console
    assert 5 <= watched["killed_after"] < N
    assert set(resumed) == {s for s in (10, 15, 20) if s > watched["killed_after"]}
    assert watched["result"]["step"] == N
    assert "tieflax: tasks at step 20: tf_mc/acc " in console
    assert foreign_problems(console) == [], console
    # Step time and throughput are metrics too (not for the first interval after each start: compilation).
    rows = {r["step"]: r for r in read_metrics(watched["workdir"], "train")}
    assert "step_time" not in rows[5] and rows[20]["step_time"] > 0
    assert rows[20]["tokens_per_second_per_device"] == pytest.approx(rows[20]["tokens_per_second"] / 8)


def _wandb_records(path) -> list[dict]:
    """The records of one offline W&B run, read by wandb's own reader (``wandb leet inspect --json``)."""
    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run([wandb_cli, "leet", "inspect", "--json", path], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_wandb_offline_holds_every_logged_step_and_the_resume_continues_the_same_run(watched):
    workdir = watched["workdir"]
    record = json.load(open(os.path.join(workdir, "wandb_run.json")))
    runs = sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")))
    assert len(runs) == 2, runs   # the killed start and the resume
    logged, ids = {}, set()
    for path in runs:
        for r in _wandb_records(path):
            if r["type"] == "run":
                ids.add(r["run"]["run_id"])
                assert r["run"]["run_group"] == "observers" and r["run"]["tags"] == ["micro", "tied"]
                assert r["run"]["display_name"] == "run"
                config = r["run"]["config"]["update"]
                assert config["train"]["num_steps"] == N and config["model"]["d_model"] == 32  # the whole config
            elif r["type"] == "history":
                item = r["history"]["item"]
                logged.setdefault(int(item["step"]), {}).update(item)
    assert ids == {record["id"]}
    assert f"W&B run run (id {record['id']}, continued, offline)" in watched["console"]
    metrics = read_metrics(workdir, "train")
    assert {r["step"] for r in metrics} == set(logged) == {5, 10, 15, 20}
    final = {r["step"]: r for r in metrics}
    assert logged[20]["train/loss"] == pytest.approx(final[20]["loss"], rel=1e-6)
    assert logged[20]["train/step_time"] > 0 and "train/tokens_per_second_per_device" in logged[20]
    assert "tasks/tf_mc/acc" in logged[20]
    assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))


def test_the_profile_of_steps_5_to_7_is_written_and_names_the_train_step(watched):
    traces = glob.glob(os.path.join(watched["workdir"], "profile", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1, traces
    data = open(traces[0], "rb").read()
    assert b"jit_step" in data and b"train" in data   # the jitted train step, and the step markers
    assert "tieflax: profile of steps 5-7 written to " in watched["first"]


@pytest.fixture(scope="module")
def evaluated(watched):
    """``tieflax evaluate`` of the run's step-20 checkpoint in this process: {task: {doc_id: sample}}."""
    from tieflax.eval.tasks import evaluate_tasks
    from tieflax.run.run import Run

    ref = evaluate_tasks(Run.read(watched["workdir"], command="evaluate"), EVAL_TASKS, include_path=watched["tasks"],
                         step=20, log_samples=True)
    return ref, {t: {s["doc_id"]: s for s in ref["samples"][t]} for t in EVAL_TASKS}


def _values(resps) -> list:
    """A sample's responses, flattened: log-likelihoods and is_greedy as floats, generations as text
    (lm-eval's files hold numbers and booleans as text, its results in memory as numbers)."""
    out = []
    for x in resps:
        if isinstance(x, (list, tuple)):
            out += _values(x)
        elif x in ("True", "False"):
            out.append(float(x == "True"))
        else:
            try:
                out.append(float(x))
            except ValueError:
                out.append(x)
    return out


def test_tasks_scored_during_training_equal_tieflax_evaluate_on_the_checkpoint_of_that_step(watched, evaluated):
    ref, by_doc = evaluated
    rows = {r["step"]: r for r in read_metrics(watched["workdir"], "tasks")}
    assert 20 in rows and set(rows) <= {10, 20}
    assert rows[20]["tf_mc/acc"] == ref["results"]["tf_mc"]["acc,none"]
    path = os.path.join(watched["workdir"], "lm_eval", "step_20", "samples_tf_mc.jsonl")
    ours = [json.loads(line) for line in open(path)]
    assert len(ours) == len(by_doc["tf_mc"]) == 5
    for s in ours:
        want = _values(by_doc["tf_mc"][s["doc_id"]]["resps"])
        assert _values(s["resps"]) == pytest.approx(want, abs=1e-6), s["doc_id"]


def test_two_processes_evaluate_a_bucket_run_as_one_does_per_sample(watched, evaluated, gcs, tmp_path):
    """``tieflax evaluate`` under 2 processes x 4 devices (gloo) on the run copied to a bucket: process 0
    drives lm-eval, the other computes its share of every batch; every sample equals one process's
    (log-likelihoods, rolling log-likelihoods, greedy generations)."""
    from tieflax import storage

    run = gcs.new_bucket() + "/runs/watched"
    local = watched["workdir"]
    for path in storage.walk_files(local):
        rel = os.path.relpath(path, local)
        if rel.split(os.sep)[0] in ("config.json", "data.json", "tokenizer.json", "checkpoints"):
            storage.upload_file(path, storage.join(run, *rel.split(os.sep)))
    out = str(tmp_path / "lm_eval")
    cmd = ["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "4", sys.executable, "-m",
           "tieflax.cli", "evaluate", "--workdir", run, "--tasks", ",".join(EVAL_TASKS), "--include-path",
           watched["tasks"], "--step", "20", "--output", out, "--log-samples"]
    env = subprocess_env(4, WORKDIR_LOGS=str(tmp_path))
    env["XLA_FLAGS"] = suite_xla_flags(None)  # the launcher sets the per-process device count
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
                          start_new_session=True)
    other = open(tmp_path / "process_1.log").read() if (tmp_path / "process_1.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n--- process 1 ---\n{other[-3000:]}"
    assert "|tf_mc " in proc.stdout and "tf_mc" not in other   # process 0 alone prints (and writes)
    ref, by_doc = evaluated
    for task in EVAL_TASKS:
        [path] = glob.glob(os.path.join(out, "*", f"samples_{task}_*.jsonl"))
        samples = [json.loads(line) for line in open(path)]
        assert len(samples) == len(by_doc[task]) > 0
        for s in samples:
            want = _values(by_doc[task][s["doc_id"]]["resps"])
            got = _values(s["resps"])
            assert [x for x in got if isinstance(x, str)] == [x for x in want if isinstance(x, str)]
            assert got == pytest.approx(want, abs=1e-6), (task, s["doc_id"])


def test_two_processes_sample_as_one_does_and_process_0_alone_prints(watched, tmp_path, capsys):
    """``tieflax sample`` under 2 processes x 4 devices (gloo) joins one job on the run's mesh: process 0
    prints the continuation one process gives (sampled, so the seed's draws must agree too); process 1
    prints nothing. Alone, each process would load the run on its own 4 devices and both would print."""
    from tieflax import cli

    argv = ["sample", "--workdir", watched["workdir"], "--prompt", "def main(", "--max-new-tokens", "12",
            "--temperature", "0.8", "--seed", "1", "--step", "20"]
    assert cli.main(argv) == 0
    want = capsys.readouterr().out
    assert want.strip(), "the one-process sample printed nothing"
    cmd = ["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "4", sys.executable, "-m",
           "tieflax.cli", *argv]
    env = subprocess_env(4, WORKDIR_LOGS=str(tmp_path))
    env["XLA_FLAGS"] = suite_xla_flags(None)  # the launcher sets the per-process device count
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420,
                          start_new_session=True)
    other = open(tmp_path / "process_1.log").read() if (tmp_path / "process_1.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n--- process 1 ---\n{other[-3000:]}"
    # stdout holds the command's lines alone: gloo's "[Gloo] Rank ..." lines, which its threads print cut
    # into each other, go to stderr (tieflax.hardware.distributed)
    assert proc.stdout.splitlines() == want.splitlines(), (proc.stdout, want)
    assert want.strip() not in other, other[-3000:]


# ------------------------------------------------------------------------------------------ units

def test_interval_line_shows_mfu_and_memory_where_known():
    from tieflax.hardware import flops
    from tieflax.run.console import device_memory, interval_line

    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

        def memory_stats(self):
            return {"bytes_in_use": 3 << 30, "peak_bytes_in_use": 5 << 30, "bytes_limit": 80 << 30}

    summary = {"loss": 2.5, "learning_rate": 3e-4, "step_time": 0.5, "tokens_per_second_per_device": 8192.0,
               **flops.throughput(0.5 * 989e12 * 0.4 * 8, 0.5, [Device()] * 8), **device_memory([Device()] * 2)}
    line = interval_line(100, 1000, summary)
    assert line == ("tieflax: step 100/1000 | loss 2.5000 | lr 3.00e-04 | 0.5 s/step | 8,192 tokens/s/device | "
                    "396 TFLOP/s/device | MFU 40.0% | memory 3.00 of 80.0 GiB"), line
    assert summary["memory_peak_gib"] == 5.0


def test_console_modes(capsys):
    import io

    from tieflax.run.console import Console, for_study, resolve

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert resolve("auto", io.StringIO()) == (True, False) and resolve("auto", Tty()) == (True, True)
    assert resolve("quiet") == (False, False) and resolve("bar") == (False, True)
    assert for_study("lines") == "lines" and for_study("auto") in ("bar", "quiet")
    quiet = Console("quiet", 10, 0)
    quiet.interval(5, {"loss": 1.0})
    quiet.progress("checkpoint of step 5 saved: checkpoints/5")
    quiet.event("resuming from step 5 (checkpoints/5)")
    assert capsys.readouterr().out == "tieflax: resuming from step 5 (checkpoints/5)\n"


@pytest.mark.parametrize("field,value,needle", [
    ("console", "loud", "config.train.console"), ("trackers", ("tensorboard", "mlflow"), "config.train.trackers"),
    ("profile_steps", (7, 5), "config.train.profile_steps"), ("eval_tasks", "arc_easy", "config.train.eval_tasks"),
    ("eval_tasks_every", -1, "config.train.eval_tasks_every"), ("wandb_tags", ("a", 1), "config.train.wandb_tags")])
def test_bad_settings_are_one_line_naming_the_field(field, value, needle):
    from tieflax.config import default_config, validate_config
    from tieflax.model import ConfigError

    c = default_config()
    with c.train.ignore_type():
        c.train[field] = value
    with pytest.raises(ConfigError, match=needle) as e:
        validate_config(c)
    assert "\n" not in str(e.value)


def test_a_missing_tracker_package_is_one_line(monkeypatch):
    import importlib.util

    from tieflax.run.trackers import TrackerError, check_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(TrackerError, match=r"pip install -e '\.\[wandb\]'"):
        check_installed(("tensorboard", "wandb"))


def test_on_a_bucket_the_profile_and_the_wandb_files_are_copied_and_the_run_id_kept(gcs, tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    import wandb
    from tieflax import storage
    from tieflax.config import default_config
    from tieflax.run.layout import RunDir
    from tieflax.run.profiler import ProfileWindow
    from tieflax.run.trackers import WandB

    for k, v in _wandb_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    run = gcs.new_bucket() + "/runs/x"
    window = ProfileWindow((1, 1), RunDir.at(run))
    window.before(1)
    with window.step(1):
        out = jax.jit(lambda x: x @ x)(jnp.ones((8, 8)))
    window.after(1, out)
    assert [f for f in storage.walk_files(storage.join(run, "profile")) if f.endswith(".xplane.pb")]
    ids = []
    for step in (1, 2):   # a start and a resume
        if step == 2:  # W&B names a run's folder offline-run-<second>-<id>: a resume in the same second
            time.sleep(1.1)  # would reuse the start's folder name, and there would be one folder to count
        tracker = WandB(RunDir.at(run), default_config())
        tracker.log(step, {"train/loss": 1.0 / step})
        tracker.close()
        ids.append(json.loads(storage.read_text(storage.join(run, "wandb_run.json")))["id"])
    wandb.teardown()
    assert ids[0] == ids[1]
    files = storage.walk_files(storage.join(run, "wandb"))
    assert len({f.split("/offline-run-")[1].split("/")[0] for f in files if "/offline-run-" in f}) == 2


def test_tensorboard_writes_events_without_importing_torch(tmp_path):
    """tensorboardX imports torch (and boto3, google-cloud-storage) whenever installed; the tracker hides them
    for that import (about 1.9 s of CPU in every training process) and they stay importable afterwards."""
    pytest.importorskip("torch")
    code = ("import sys\n"
            "from tieflax.run.layout import RunDir\n"
            "from tieflax.run.trackers import TensorBoard\n"
            "tb = TensorBoard(RunDir.at(sys.argv[1])); tb.log(3, {'loss': 2.5}); tb.flush(); tb.close()\n"
            "print('torch imported:', 'torch' in sys.modules, 'boto3' in sys.modules)\n"
            "import torch, boto3; print('then torch', torch.__version__)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch imported: False False" in proc.stdout and "then torch" in proc.stdout, proc.stdout
    assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*")), os.listdir(tmp_path)
