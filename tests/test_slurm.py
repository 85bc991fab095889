"""launch/slurm_gpu.sbatch on a one-node SLURM cluster on 127.0.0.1 (Debian's slurm-wlm), 2 tasks over gloo.

The module's fixture writes a slurm.conf for one node (``localhost``, 2 CPUs, one partition) into a
temporary folder, with its state, spool, logs and free ports there, and starts munged (a key made there),
slurmctld and slurmd as child processes in the foreground; it waits until ``sinfo`` shows the node idle
and stops all three at the end. Without the binaries on PATH, or when a daemon cannot start (not root, no
munge...), the test is skipped with the reason: CI has no SLURM.

The job is the published script itself, its GPU lines overridden on the sbatch command line
(``--gpus-per-node=0 --ntasks-per-node=2 --cpus-per-task=1``) and ``JAX_PLATFORMS=cpu`` in the submitting
environment, which SLURM passes on to the tasks: a 4-step micro run, 2 processes x 1 CPU device (one device
per task, as one GPU per task on a GPU cluster).
"""

from __future__ import annotations

import json
import math
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from train_support import (REPO, config_overrides, free_port, micro_config, prepare_shared_data,
                                subprocess_env)

SCRIPT = os.path.join(REPO, "launch", "slurm_gpu.sbatch")
CLIENTS = ("sbatch", "sinfo", "squeue", "scancel")
START_TIMEOUT_S = 30
JOB_TIMEOUT_S = 240
DEVICES_PER_TASK = 1


def _missing_binaries() -> str | None:
    for name in ("slurmctld", "slurmd", "munged", *CLIENTS):
        if shutil.which(name) is None:
            return (f"{name} not found on PATH: install Debian's slurm-wlm (apt-get install slurm-wlm, which "
                    f"brings munge) to run this test")
    return None


def _last_error(log_paths: list[str]) -> str:
    """The daemon's own last error line (or its last line) from its log files."""
    lines = []
    for path in log_paths:
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                lines += [ln.strip() for ln in f if ln.strip()]
    errors = [ln for ln in lines if re.search(r"error|fatal", ln, re.IGNORECASE)]
    return (errors or lines or ["(no output)"])[-1]


def _slurm_conf(root: str, user: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=tieflaxtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for name in reversed(list(procs)):  # slurmd, slurmctld, then munged
        proc = procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster; yields the environment for its client commands (SLURM_CONF set)."""
    missing = _missing_binaries()
    if missing:
        pytest.skip(missing)
    root = str(tmp_path_factory.mktemp("slurm"))
    os.chmod(root, 0o700)
    for sub in ("state", "spool", "log"):
        os.mkdir(os.path.join(root, sub))
    user = pwd.getpwuid(os.getuid()).pw_name
    conf = os.path.join(root, "slurm.conf")
    with open(conf, "w") as f:
        f.write(_slurm_conf(root, user, free_port(), free_port()))
    key = os.path.join(root, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["SLURM_CONF"] = conf
    log = os.path.join(root, "log")
    commands = {
        "munged": ["munged", "--foreground", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
                   f"--log-file={log}/munged.log", f"--pid-file={root}/munged.pid",
                   f"--seed-file={root}/munged.seed"],
        "slurmctld": ["slurmctld", "-D", "-f", conf],
        "slurmd": ["slurmd", "-D", "-N", "localhost", "-f", conf],
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in commands.items():
            out = open(os.path.join(log, f"{name}.out"), "w")
            procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
            out.close()
            if name == "munged":  # slurmctld needs its socket
                deadline = time.monotonic() + START_TIMEOUT_S
                while not os.path.exists(f"{root}/munge.socket") and procs[name].poll() is None \
                        and time.monotonic() < deadline:
                    time.sleep(0.1)
        deadline, state = time.monotonic() + START_TIMEOUT_S, ""
        while time.monotonic() < deadline:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    reason = _last_error([os.path.join(log, f"{name}.out"), os.path.join(log, f"{name}.log")])
                    pytest.skip(f"{name} could not start (exit {proc.returncode}): {reason}")
            state = subprocess.run(["sinfo", "-h", "-N", "-n", "localhost", "-o", "%t"], env=env,
                                   capture_output=True, text=True).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            reason = _last_error([os.path.join(log, f"{n}.{e}") for n in ("slurmctld", "slurmd")
                                  for e in ("out", "log")])
            pytest.skip(f"the SLURM node was not idle within {START_TIMEOUT_S} s "
                        f"(sinfo: {state or 'no answer'}): {reason}")
        yield env
    finally:
        if "slurmctld" in procs and procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", user], env=env, capture_output=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
                time.sleep(0.5)
        _stop(procs)
    left = _processes_mentioning(root)
    assert not left, f"daemons left running: {left}"


def test_sbatch_script_trains_with_two_tasks_over_gloo(slurm, tmp_path):
    data_dir, workdir = str(tmp_path / "data"), str(tmp_path / "run")
    prepare_shared_data(data_dir)
    config = micro_config(data_dir, num_steps=4)
    config.train.log_every, config.train.checkpoint_every = 1, 2

    # What the tasks get: this environment (sbatch passes it on), one CPU device per process, none of the
    # explicit coordinator variables of launch/local_multiprocess.sh (SLURM's own describe the job).
    env = {k: v for k, v in subprocess_env(DEVICES_PER_TASK, JAX_COORDINATOR_PORT=str(free_port())).items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "TIEFLAX_"))}
    env["SLURM_CONF"] = slurm["SLURM_CONF"]
    if os.path.exists(os.path.join(sys.prefix, "bin", "activate")):
        env["TIEFLAX_VENV"] = sys.prefix  # the script activates it: `tieflax` on the tasks' PATH
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    output = str(tmp_path / "job-%j.out")
    cmd = ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
           "--time=10", f"--output={output}", SCRIPT,
           "--config", os.path.join(REPO, "configs", "experiments", "tiny.py"), "--workdir", workdir,
           *config_overrides(config)]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True,
                              timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--full", "--name=tieflax"], env=slurm, capture_output=True)
        pytest.fail(f"the SLURM job did not end within {JOB_TIMEOUT_S} s")
    job = re.search(r"Submitted batch job (\d+)", proc.stdout)
    log_path = output.replace("%j", job.group(1)) if job else ""
    log = open(log_path).read() if os.path.exists(log_path) else "(no job output)"
    assert proc.returncode == 0, (f"sbatch --wait: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n"
                                  f"{log[-6000:]}")
    print(f"SLURM job {job.group(1)}: {time.monotonic() - started:.1f} s")

    from tieflax.run import checkpoints as ckpt  # noqa: PLC0415
    from tieflax.run.metrics import read_metrics  # noqa: PLC0415

    assert ckpt.latest_step(workdir) == 4, log[-4000:]
    # Each process saves its own data-iterator state: both tasks were processes of one 2-process run.
    saved = sorted(name for _, _, files in os.walk(os.path.join(workdir, ckpt.CHECKPOINT_DIR, "4"))
                   for name in files if re.fullmatch(r"process_\d+-of-\d+\.json", name))
    assert saved == ["process_0-of-2.json", "process_1-of-2.json"], saved
    losses = {r["step"]: r["loss"] for r in read_metrics(workdir, "train")}
    assert sorted(losses) == [1, 2, 3, 4], losses
    assert all(math.isfinite(loss) and loss > 0 for loss in losses.values()), losses
    assert [r["step"] for r in read_metrics(workdir, "val")] == [4], "no validation metrics at the last step"
    # Process 0's summary (only it prints) of the run both processes trained.
    summary = json.loads([ln for ln in log.splitlines() if ln.startswith('{"step": 4')][-1])
    assert summary["final_val_loss"] > 0 and not summary["preempted"], summary
    assert "[Gloo] Rank 1 is connected to 1 peer ranks" in log, log[:2000]  # the CPU collectives: gloo
