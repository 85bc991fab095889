"""The scripts under launch/ and benchmarks/ that take arguments: ``--help`` prints the usage, exits 0 and does
nothing else; an argument they do not know is refused in one line, with status 2, before anything runs.
Each case runs where doing the work would show: a fake ``python``/``srun``/``gcloud`` records calls, a
folder the work would delete is there to be deleted, and a benchmark's JAX has no platform to run on."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from pod_support import fake_pod, launch_pod

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_MEASURE = os.path.join(REPO, "launch", "gpu_measure.sh")
LOCAL = os.path.join(REPO, "launch", "local_multiprocess.sh")
SLURM = os.path.join(REPO, "launch", "slurm_gpu.sbatch")

RECORDER = """#!/usr/bin/env bash
printf '%s ' "$0" "$@" >> "{calls}"; echo >> "{calls}"
"""


def _recorder(tmp_path, name: str):
    """An executable ``tmp_path/bin/name`` that only records its calls in ``tmp_path/calls``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(RECORDER.format(calls=tmp_path / "calls"))
    path.chmod(0o755)
    return path


def _one_line_refusal(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and not proc.stdout, (proc.stdout, proc.stderr)
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


# ------------------------------------------------------------------------------- launch/gpu_measure.sh

def _gpu_measure(tmp_path, *args):
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "kept").write_text("a profile from before")
    env = {**os.environ, "PYTHON": str(_recorder(tmp_path, "python")), "OUT": str(tmp_path / "out"),
           "PROFILE_DIR": str(profile)}
    proc = subprocess.run(["bash", GPU_MEASURE, *args], env=env, capture_output=True, text=True, timeout=60)
    # nothing ran: no Python started, the profile folder is still there, no output folder was made
    assert not (tmp_path / "calls").exists(), (tmp_path / "calls").read_text()
    assert (profile / "kept").exists() and not (tmp_path / "out").exists()
    return proc


def test_gpu_measure_help_prints_the_usage_and_runs_nothing(tmp_path):
    """`--help` ran the whole measurement, deleting the profile folder first."""
    proc = _gpu_measure(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# The train step on one GPU") and "Usage:" in proc.stdout, proc.stdout
    assert "launch/gpu_measure.sh wheels" in proc.stdout and "set -uo" not in proc.stdout


def test_gpu_measure_refuses_an_unknown_argument_in_one_line(tmp_path):
    _one_line_refusal(_gpu_measure(tmp_path, "--profile", "/tmp/x"), "unknown argument '--profile'", "--help")


def test_gpu_measure_wheels_takes_nothing_after_it(tmp_path):
    _one_line_refusal(_gpu_measure(tmp_path, "wheels", "extra"), "'extra'")


# ------------------------------------------------------------------------------------ benchmarks/gpu.py

def _gpu_benchmark(*args):
    # A platform that does not exist: any work (the first jax.devices()) fails, at once.
    env = {**os.environ, "JAX_PLATFORMS": "no-such-platform", "SMOKE": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu.py"), *args], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_gpu_benchmark_help_prints_the_usage_and_runs_nothing():
    """`--help` started the benchmark (its arguments were ignored); a wrong one is one line, status 2."""
    proc = _gpu_benchmark("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: gpu.py") and "--smoke" in proc.stdout and "--budget-s" in proc.stdout
    proc = _gpu_benchmark("--bogus")
    _one_line_refusal(proc, "gpu.py: unrecognized arguments: --bogus", "--help")


# ---------------------------------------------------------------------------- launch/local_multiprocess.sh

def test_local_multiprocess_help_and_bad_counts(tmp_path):
    """`--help` printed the usage with status 2; a count that is no number started no process and exited 0."""
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    _recorder(tmp_path, "job")

    def run(*args):
        return subprocess.run(["bash", LOCAL, *args], env=env, capture_output=True, text=True, timeout=60)

    proc = run("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("# N CPU processes") and "Usage:" in proc.stdout, proc
    assert "set -euo" not in proc.stdout
    _one_line_refusal(run("two", "4", "job"), "NUM_PROCESSES 'two'")
    _one_line_refusal(run("0", "4", "job"), "NUM_PROCESSES '0'")
    _one_line_refusal(run("2", "-1", "job"), "DEVICES_PER_PROCESS '-1'")
    _one_line_refusal(run("2", "4"), "(see --help)")
    assert not (tmp_path / "calls").exists()


# ------------------------------------------------------------------------------- launch/slurm_gpu.sbatch

def test_slurm_script_help_prints_the_usage_and_starts_no_task(tmp_path):
    """`--help` started `srun ... tieflax train --help` on every task."""
    _recorder(tmp_path, "srun")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", SLURM, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# Train on GPU nodes under SLURM") and "Usage:" in proc.stdout, proc.stdout
    assert "#SBATCH --" not in proc.stdout  # the directives are not part of it
    assert not (tmp_path / "calls").exists()


# ----------------------------------------------------------------------------------- launch/tpu_pod.sh

def _known():
    from tieflax.cli import COMMANDS, RENAMED

    return [*COMMANDS, *RENAMED]


def test_pod_launcher_refuses_an_unknown_tieflax_command_before_any_host_runs(tmp_path):
    """`-- trian` said "started on 2 host(s)" with status 0 while each host's log said the command is
    unknown: it is refused in one line that names it and lists the commands of tieflax's own CLI."""
    env = fake_pod(tmp_path, 2)
    proc = launch_pod(env, "--no-install", "--tag", "t", "tpu1", "zone1", "--", "trian", "--workdir", "w")
    _one_line_refusal(proc, "unknown tieflax command 'trian'", ", ".join(_known()))
    assert not os.path.exists(os.path.join(env["FAKE_ROOT"], "calls"))  # nothing reached gcloud
    proc = launch_pod(env, "--dry-run", "tpu1", "zone1", "--", "eval", "--workdir", "w")  # a renamed one: known
    assert proc.returncode == 0, proc.stderr


def test_pod_launcher_checks_the_command_against_the_tieflax_it_installs(tmp_path):
    """The list is that of the code the hosts get: a --code tree's, a --wheel's (read without jax). A --code
    folder that is no git checkout (the launcher copies its tracked files) is one line too."""
    cli = "COMMANDS = {'only': 'x.only'}\nRENAMED = {'old': 'only'}\n"
    tree = tmp_path / "tree"
    (tree / "tieflax").mkdir(parents=True)
    (tree / "tieflax" / "__init__.py").write_text("")
    (tree / "tieflax" / "cli.py").write_text(cli)
    wheel = tmp_path / "tieflax-9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tieflax/__init__.py", "")
        z.writestr("tieflax/cli.py", cli)
    env = fake_pod(tmp_path, 1)
    proc = launch_pod(env, "--code", str(tree), "tpu1", "zone1", "--", "only")  # git's "fatal:", status 128
    _one_line_refusal(proc, f"--code {tree}: not a git checkout")
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "add", "-A"], check=True)
    for install in (["--code", str(tree)], ["--wheel", str(wheel)]):
        proc = launch_pod(env, *install, "tpu1", "zone1", "--", "train", "--workdir", "w")
        _one_line_refusal(proc, "unknown tieflax command 'train'", "only, old")
        proc = launch_pod(env, "--dry-run", *install, "tpu1", "zone1", "--", "old", "--workdir", "w")
        assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(os.path.join(env["FAKE_ROOT"], "calls"))
