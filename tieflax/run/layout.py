"""Every name in a run directory, once, and what counts as a run.

A run directory (``--workdir``, local or ``gs://bucket/runs/NAME``) holds::

    config.json              the config the run trains with (created once; never rewritten by a resume)
    config_history/<n>.json  n = 1, 2, ...: each change of a result field made on purpose
                             (``--allow-change``), numbered, create-only (``tieflax.run.identity``)
    data.json                what the run trains on: the data's source, content key, tokenizer digest
    tokenizer.json           the tokenizer its ids come from (trained, imported, or a copy)
    data_cache/              the content-hashed token cache of ``data.source`` corpora and files
    checkpoints/<step>/      orbax: ``state`` {'step', 'params', 'opt_state'} and ``data`` (the iterator)
    checkpoints_unreadable/<step>   checkpoints a resume found damaged, set aside (never deleted)
    initial_params/          parameters a fresh run starts from (imports and surgery write them)
    surgery.json             what a surgery kept, discarded and reset
    hf_files/                tokenizer and generation files carried from an imported Hugging Face folder
    imported_from.json       the Hugging Face folder an import read (written by ``convert --from-hf``,
                             copied by surgery): ``convert --to-hf`` never writes over it
    metrics/<session>-<seq>.jsonl   metric rows, one immutable segment per log period
    metrics.jsonl            the metrics of runs written before segments (still read)
    tensorboard/             TensorBoard event files
    wandb_run.json           the Weights & Biases run this run logs to (id, project, ...): a resume continues it
    wandb/                   W&B's local files of that run (offline runs: ``wandb sync wandb/offline-run-*``)
    profile/                 JAX profiler traces of ``train.profile_steps`` (plugins/profile/<time>/*.xplane.pb)
    tieflax.lock             while a command writes here (a lease object on gs:// and s3://)
    tieflax.incomplete       on gs:// / s3://: an import or surgery is writing this prefix
    analysis/                what the study and ``tieflax analyze`` measured on this run (step_<n>.json,
                             compare.json, tasks.json, plots)
    lm_eval/                 lm-eval's own results and samples of the study's benchmark tasks
    lm_eval/step_<n>/        results.json and samples_<task>.jsonl of ``train.eval_tasks`` scored at step n
    sweep_result.json        a sweep run's final loss and the result fields it was trained with

Nothing here imports JAX or orbax: every module may ask this one for a name, and only ``tieflax.run``
decides what a run folder holds.
"""

from __future__ import annotations

import dataclasses

from tieflax import storage
from tieflax.data.tokenizer import TOKENIZER_FILE  # noqa: F401 (re-exported: the tokenizer's file name is the data layer's)
from tieflax.errors import UserError

CONFIG_FILE = "config.json"
CONFIG_HISTORY_DIR = "config_history"
DATA_RECORD_FILE = "data.json"
DATA_CACHE_DIR = "data_cache"
CHECKPOINT_DIR = "checkpoints"
UNREADABLE_DIR = "checkpoints_unreadable"
INITIAL_PARAMS_DIR = "initial_params"
SURGERY_FILE = "surgery.json"
HF_FILES_DIR = "hf_files"
IMPORT_SOURCE_FILE = "imported_from.json"
METRICS_DIR = "metrics"
LEGACY_METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_FILE = "wandb_run.json"
WANDB_DIR = "wandb"
PROFILE_DIR = "profile"
LOCK_FILE = "tieflax.lock"
INCOMPLETE_MARKER = "tieflax.incomplete"
ANALYSIS_DIR = "analysis"
LM_EVAL_DIR = "lm_eval"
LM_EVAL_STEP_DIR = "step_{step}"  # under LM_EVAL_DIR: tasks scored during training at that step
SWEEP_RESULT_FILE = "sweep_result.json"
PARTIAL_TAG = ".partial-"  # local imports are written into <parent>/.<name>.partial-<pid>, then renamed

# What training or an import leaves beside config.json: with one of these the folder is a run.
RUN_CONTENT = (CHECKPOINT_DIR, INITIAL_PARAMS_DIR, LEGACY_METRICS_FILE, METRICS_DIR)


class WorkdirError(UserError, RuntimeError):
    """The workdir cannot be used as asked; the message names it and what to do."""


def canonical(folder: str) -> str:
    """``folder`` as the run layer names a folder it reads or writes (a run, a destination, an output):
    an absolute local path or a URL without a trailing slash (``storage.resolve``; a malformed URL is
    refused in one line). The run layer's one resolution: ``RunDir`` and ``tieflax.run.destinations`` go
    through it."""
    return storage.resolve(folder)


def check_location(workdir: str) -> str:
    """The workdir resolved (``canonical``); refuses, before any work, one that is a file or that
    cannot hold checkpoints.

    orbax-checkpoint (0.12.8, the newest release) sends checkpoint arrays to TensorStore's gcs driver for
    ``gs://`` and its file driver for everything else: ``s3://b/run`` becomes the relative path
    ``s3:/b/run`` ("Checkpoint path should be absolute"). Token stores and data files on s3:// are
    read and written by tieflax itself and work there."""
    workdir = canonical(workdir)
    if storage.is_remote(workdir):
        if storage.bucket_and_key(workdir)[0] == "s3":
            raise WorkdirError(
                f"{workdir} cannot hold checkpoints: orbax-checkpoint writes checkpoint arrays to local paths "
                "and gs:// only, not s3://. Put the run on gs:// or a local disk (a token store or data files "
                "may stay on s3://)")
    elif storage.exists(workdir) and not storage.is_dir(workdir):
        raise WorkdirError(f"--workdir {workdir} is a file, not a folder: choose another path")
    return workdir


@dataclasses.dataclass(frozen=True)
class RunDir:
    """Where a run lives, resolved and checked once (``RunDir.at``): what every reader and writer of the
    run is handed in place of the ``--workdir`` string, so none of them resolves or checks it again.

    ``path``  the canonical local path or URL (``storage.resolve``), as every message names the run
    """

    path: str

    @classmethod
    def at(cls, workdir: str) -> "RunDir":
        """``workdir`` resolved and checked (``check_location``): a file, or a store orbax cannot write
        checkpoints to, is refused here, before any work."""
        return cls(check_location(workdir))

    @classmethod
    def of(cls, workdir: "RunDir | str") -> "RunDir":
        """A RunDir as given (the run handle's), or a path (a notebook's, a study's) resolved and checked
        here, once (``RunDir.at``)."""
        return workdir if isinstance(workdir, RunDir) else cls.at(workdir)

    @classmethod
    def named(cls, workdir: "RunDir | str") -> "RunDir":
        """A RunDir as given, or a string resolved as the run layer names it (``canonical``): for the
        readers a notebook, a test or a study calls with a path; the run handle passes its own."""
        return workdir if isinstance(workdir, RunDir) else cls(canonical(workdir))

    def file(self, *names: str) -> str:
        """``<path>/<names...>``: a name of this module inside the run."""
        return storage.join(self.path, *names)

    @property
    def is_remote(self) -> bool:
        return storage.is_remote(self.path)

    def __str__(self) -> str:
        return self.path


def is_run(folder: str) -> bool:
    """True when ``folder`` holds a tieflax run (``config.json`` with checkpoints, initial parameters or
    metrics) or is held by a command (its lock). A lone config.json (a Hugging Face folder) is not one."""
    there = lambda n: storage.exists(storage.join(folder, n))  # noqa: E731
    return there(LOCK_FILE) or (there(CONFIG_FILE) and any(there(n) for n in RUN_CONTENT))


def holds_a_run(folder: str) -> bool:
    """True when ``folder`` holds anything a run left (its config, checkpoints, parameters or metrics)."""
    return any(storage.exists(storage.join(folder, n)) for n in (CONFIG_FILE, *RUN_CONTENT))
