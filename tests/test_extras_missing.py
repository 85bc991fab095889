"""Optional extras (setup.cfg): a command whose extra is not installed says which to install, in one line;
`tieflax sample` needs none (it ran through the lm-eval backend and ended in lm_eval's 11-line
ModuleNotFoundError on the Quick-start install); `tieflax evaluate` of a hub task offline is one line.

"Not installed" is made here by a finder that refuses the package's import in a fresh interpreter, as a
base install would (the test environment has every extra)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cli_support import WITHOUT
from train_support import suite_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "experiments", "tiny.py")
SEQ = 32
TRAIN = ["--config.model.vocab_size=512", "--config.data.tokenizer.vocab_size=512", "--config.model.d_model=32",
         "--config.model.n_layers=1", "--config.model.n_heads=2", "--config.model.d_ff=64",
         f"--config.model.max_seq_len={SEQ}", f"--config.train.seq_len={SEQ}", "--config.train.num_steps=2",
         "--config.train.global_batch_size=8", "--config.train.eval_every=1000", "--config.train.eval_batches=1"]

ONE_DEVICE = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": suite_xla_flags(1)}


def _tieflax(*args, without: str = "", **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, without, *args], capture_output=True, text=True,
                          timeout=900, cwd=REPO, env={**os.environ, **ONE_DEVICE, **env})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("extras") / "run")
    proc = _tieflax("train", "--config", TINY, "--workdir", workdir, *TRAIN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_sample_runs_on_the_base_install_without_lm_eval(run):
    proc = _tieflax("sample", "--workdir", run, "--prompt", "In the beginning", "--max-new-tokens", "4",
                    without="lm_eval,torch,transformers,datasets,wandb,tensorboard")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stdout


@pytest.mark.parametrize("hidden, args, extra", [
    ("lm_eval", ["evaluate", "--workdir", "RUN", "--tasks", "arc_easy"], "eval"),
    ("wandb", ["train", "--config", TINY, "--workdir", "NEW", *TRAIN, "--config.train.trackers=('wandb',)"], "wandb"),
])
def test_a_command_whose_extra_is_missing_says_which_to_install_in_one_line(run, tmp_path, hidden, args, extra):
    args = [run if a == "RUN" else str(tmp_path / "new") if a == "NEW" else a for a in args]
    proc = _tieflax(*args, without=hidden)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert f"'tieflax[{extra}]'" in lines[0] or f"'.[{extra}]'" in lines[0], lines


def test_a_missing_extra_names_the_package_and_its_extra():
    from tieflax.cli import one_line

    line = one_line(ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval.api"))
    assert line == ("this needs the optional package 'lm_eval', from tieflax's 'eval' extra: pip install "
                    "'tieflax[eval]' (or pip install -e '.[eval]' in a clone)")
    assert one_line(ModuleNotFoundError("No module named 'jax'", name="jax")) is None  # a broken install: a bug


def test_evaluate_of_a_hub_task_offline_is_one_line(run):
    """Offline (no network; HF_HUB_OFFLINE unset, as a user's shell would be): about 22 lines of
    huggingface_hub retry warnings, each twice, came before the one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update({"HF_HOME": os.path.join(os.path.dirname(run), "hf_home"), **ONE_DEVICE})
    proc = subprocess.run([sys.executable, "-m", "tieflax.cli", "evaluate", "--workdir", run, "--tasks",
                           "arc_easy", "--limit", "2"], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("tieflax evaluate: Couldn't reach 'allenai/ai2_arc' on the Hub"), lines
    assert "cannot be reached and the task's data is not in the local cache" in lines[0], lines
