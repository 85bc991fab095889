"""The compute side of one training session: what trains, built from plain values and never from the run
handle.

    session = Session(config, model, where)   # the mesh checked, the data prepared (cached in ``where``)
    run.adopt_data(session.data.info, session.tokenizer_json)
    with session.on_mesh():
        session.compile()                       # the loader, the state's layout, the steps, lm-eval tasks
        ...session.train_step(state, batch), session.evaluate(params)...

``config`` is the config the run was opened with and ``model`` its validated ``ModelConfig``; ``where`` the
run's folder (``RunDir``), the one thing of the run it is told: the data's cache and tokenizer, and
lm-eval's result files, are kept there. The ``Run`` (record, checkpoints, metrics, lock) stays with
``tieflax.train.loop.train_run``, which brings the two together.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from tieflax import sharding as shd
from tieflax.hardware import flops
from tieflax.model.config import ModelConfig
from tieflax.model.params import param_report
from tieflax.run.layout import RunDir
from tieflax.train.step import build, make_eval_step, make_train_step, setup_mesh
from tieflax.train.val_loss import run_eval


class Session:
    """The compute side of a training session (module docstring). Attributes appear as they are built:

    ``config``, ``model``, ``where``   as given
    ``mesh``, ``data``                 at construction: the mesh (checked against the config) and the
                                       prepared data (``tieflax.data.prepare_dataset``)
    ``loader``, ``setup``, ``train_step``, ``eval_step``, ``tasks``   after ``compile`` (on the mesh)
    """

    def __init__(self, config: ml_collections.ConfigDict, model: ModelConfig, where: RunDir):
        from tieflax.data import prepare_dataset  # noqa: PLC0415

        self.config, self.model, self.where = config, model, where
        self.mesh = setup_mesh(config)  # refused before any data is read when the config does not fit it
        self.data = prepare_dataset(config.data, where.path, vocab_size=model.vocab_size)
        self.loader = self.setup = self.train_step = self.eval_step = self.tasks = None

    @property
    def tokenizer_json(self) -> str | None:
        """The tokenizer the data's ids come from, as JSON (None for pre-tokenised data without one)."""
        return self.data.tokenizer.to_str() if self.data.tokenizer is not None else None

    @contextlib.contextmanager
    def on_mesh(self) -> Iterator[None]:
        """The mesh, and the rules that map the logical names of parameters and activations onto it: inside,
        the activations' ``with_logical_constraint``s take effect."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
            yield

    def compile(self) -> None:
        """On the mesh: the train loader, the state's layout (``Setup``), the eval and train steps, and the
        lm-eval tasks (``train.eval_tasks``: an unknown one fails here, before training)."""
        from tieflax.data import make_loader  # noqa: PLC0415

        t = self.config.train
        self.loader = make_loader(self.data, "train", seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                                  seed=self.config.seed)
        self.setup = build(self.config, self.mesh)
        self.eval_step = make_eval_step(self.config, self.setup)
        self.train_step = make_train_step(self.config, self.setup)
        if t.eval_tasks:
            from tieflax.eval.tasks import TrainingTasks  # noqa: PLC0415

            self.tasks = TrainingTasks(self.config, self.model, self.data.tokenizer, self.mesh, self.where,
                                       write=jax.process_index() == 0)

    def evaluate(self, params: Any) -> dict:
        """The validation loss of ``params`` (``run_eval``)."""
        return run_eval(self.eval_step, params, self.data, self.config, self.mesh)

    def fresh_state(self, params: Any = None) -> Any:
        """A state at step 0: ``params`` (imported or converted) with a fresh optimizer, else initialised from
        ``config.seed``."""
        s = self.setup
        if params is None:
            return s.init_state(jax.random.key(self.config.seed))
        return {"step": jax.device_put(jnp.zeros((), jnp.int32), s.state_shardings["step"]), "params": params,
                "opt_state": s.init_opt_state(params)}

    def step_flops(self) -> float:
        """Model FLOPs of one train step (``tieflax.hardware.flops``)."""
        t = self.config.train
        return flops.step_flops(self.model, t.global_batch_size, t.seq_len).train

    def param_report(self) -> dict:
        return param_report(self.model).as_dict()
