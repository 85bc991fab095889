"""A run's checkpoint, tokenizer and mesh, loaded for inference: what ``tieflax sample`` and the lm-eval
backend (``tieflax.eval.harness``) both start from. Needs no lm-eval, so ``sample`` runs on the base
install."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from tieflax import sharding as shd
from tieflax.eval.decode import EvalError
from tieflax.model.config import ModelConfig

if TYPE_CHECKING:
    from tieflax.run.read_only import ReadOnlyRun


@dataclasses.dataclass
class LoadedRun:
    """config: the model's ``ModelConfig``; params: placed on ``mesh`` (training layout); tokenizer: a
    ``tokenizers.Tokenizer``; eos_id / bos_id (None when the run has none); max_length: the context
    (``train.seq_len``, at most ``max_seq_len`` for learned positions)."""
    config: ModelConfig
    params: Any
    tokenizer: Any
    eos_id: int
    bos_id: Optional[int]
    mesh: jax.sharding.Mesh
    max_length: int

    def encode(self, text: str, prefix_id: int) -> list[int]:
        """As lm-eval's ``hf``: the tokenizer's special tokens are added unless ``text`` already starts
        with the prefix token's text."""
        add = not text.startswith(self.tokenizer.decode([prefix_id], skip_special_tokens=False))
        return self.tokenizer.encode(text, add_special_tokens=add).ids


def load_run(run: "ReadOnlyRun", step: Optional[int] = None) -> LoadedRun:
    """The checkpoint (latest, or ``step``), tokenizer and mesh of ``run``, a run opened for reading
    (``Run.read``: its record verified, its tokenizer checked against the record)."""
    from tieflax.config import model_config  # noqa: PLC0415
    from tieflax.data.tokenizer import TOKENIZER_FILE, bos_id_of, eos_id_of  # noqa: PLC0415

    config = run.config
    params, _ = run.params(step)  # first: a run without a checkpoint says so before its tokenizer is read
    mc = model_config(config)
    tok = run.tokenizer()  # refused when the record names another tokenizer
    if tok is None:
        raise EvalError(f"{run.path!r} has no {TOKENIZER_FILE}: evaluation needs the run's tokenizer "
                        "(runs on pre-tokenised data have none; copy the tokenizer that made them there)")
    eos = eos_id_of(tok, config.data.tokenizer.eos_token)
    bos = bos_id_of(tok, config.data.tokenizer.bos_token)
    mesh = run_mesh(config.mesh)
    max_length = int(config.train.seq_len)
    if mc.position == "learned":
        max_length = min(max_length, mc.max_seq_len)
    return LoadedRun(mc, place_params(mc, params, mesh), tok, eos, bos, mesh, max_length)


def run_mesh(mesh_config) -> jax.sharding.Mesh:
    """The run's mesh; a fixed-size one (no -1 axis) smaller than the machine takes its first devices."""
    sizes = [int(mesh_config[a]) for a in shd.MESH_AXES]
    devices = jax.devices()
    if -1 not in sizes and 0 < int(np.prod(sizes)) < len(devices):
        devices = devices[:int(np.prod(sizes))]
    return shd.mesh_from_config(mesh_config, devices)


def place_params(config: ModelConfig, params: Any, mesh) -> Any:
    """Host params -> arrays on ``mesh`` with the training layout's shardings (vocab over 'tensor')."""
    from tieflax.model.transformer import TransformerLM  # noqa: PLC0415

    abstract = jax.eval_shape(lambda: TransformerLM(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    shardings = shd.logical_shardings(abstract, mesh)["params"]
    return jax.tree.map(jax.device_put, params, shardings)
