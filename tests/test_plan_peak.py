"""``tieflax plan --explain`` (tieflax/plan/peak.py): what is live at the compiled step's peak, by origin;
and what the step no longer keeps (tieflax/model/layers.py ``recast_in_backward``, the norm of the
parameters finished before their update in tieflax/train/step.py). Compiled on this machine's CPU."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

from tieflax import plan
from tieflax.config import load_config
from tieflax.hardware import targets
from tieflax.plan.peak import ORIGINS, peak_accounting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "experiments", "tiny.py")
LAYERS = 4


def _tiny_scanned(remat: str):
    """tiny.py (4 layers, d 128, d_ff 512) with scanned layers, bf16 compute, fp32 parameters."""
    config = load_config(TINY)
    config.model.scan_layers = True
    config.model.remat = remat
    config.model.dtype = "bfloat16"
    config.model.mlp_chunk = 0
    return config


@pytest.fixture(scope="module")
def remat_none(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dump"))
    p = plan.plan_config(_tiny_scanned("none"), targets.resolve("cpu"), name="tiny", global_batch_size=8,
                         with_eval=False, dump_dir=folder, explain=True)
    return p, folder


def test_the_peak_is_accounted_to_the_byte_and_names_the_layer_stack(remat_none):
    p, folder = remat_none
    a = p.train.peak
    assert a is not None and a.places
    # The places live at the peak are the temp allocation, less what the heap could not pack.
    assert 0 < a.live_temporaries <= a.temp_allocation
    assert a.temp_allocation == p.train.temporaries
    assert {origin for origin, _, _ in a.by_origin()} <= set(ORIGINS)
    stacks = [x for x in a.places if x.origin == "saved for the backward (layer stack)"]
    assert stacks and all(re.match(rf"\w+\[{LAYERS},", x.shape) for x in stacks)
    # The same from the dump folder, and in the JSON and the table people read.
    assert peak_accounting(f"{folder}/train").live_temporaries == a.live_temporaries
    assert p.as_dict()["train"]["peak"]["live_temporaries"] == a.live_temporaries
    assert "saved for the backward (layer stack)" in plan.format_report([p])


def test_remat_none_keeps_no_compute_dtype_copy_of_the_weights(remat_none):
    """With remat 'none' the forward's layer loop stacks what the backward needs; a bf16 copy of a
    kernel (tiny: [4, 128, 512] for the MLP) is not among it: the backward casts the fp32 one again."""
    _, folder = remat_none
    hlo = max(glob.glob(f"{folder}/train/*after_optimizations.txt"), key=os.path.getsize)
    # Any [layers, d, d_ff] bf16 buffer is such a stack (XLA:CPU writes it by a fused convert and update).
    stacked = set(re.findall(rf"bf16\[{LAYERS},(?:128,512|512,128)\]", open(hlo).read()))
    assert not stacked, f"a bf16 stack of the MLP kernels is kept for the backward: {stacked}"


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None,
                    reason="needs the CUDA plugin (pip install 'jax[cuda12]') to compile for an H100")
def test_the_update_writes_the_embedding_in_place_on_an_h100(tmp_path):
    """The keep-or-update select of a step whose parameter norm XLA fused into it wrote the updated
    fp32 [V, d] embedding to a new buffer and copied it back; no such copy is left."""
    config = load_config(TINY)
    config.model.dtype = "bfloat16"
    plan.plan_config(config, targets.resolve("h100:1"), name="tiny", global_batch_size=8, with_eval=False,
                     dump_dir=str(tmp_path))
    hlo = max(glob.glob(f"{tmp_path}/train/*gpu_after_optimizations.txt"), key=os.path.getsize)
    v, d = config.model.vocab_size, config.model.d_model
    copies = re.findall(r"= (f32\[\d+,\d+\])\{[^}]*\} copy\(", open(hlo).read())
    assert not [c for c in copies if c.endswith(f",{d}]") and int(c[4:].split(",")[0]) >= v], copies
