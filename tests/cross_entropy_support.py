"""What the fused loss's tests share (tests/test_cross_entropy.py, the XLA and Pallas TPU paths;
tests/test_cross_entropy_mosaic_gpu.py, the Mosaic GPU kernels): the feature sets, the test meshes by name
and the tolerance check against the float64 oracle."""

import jax
import numpy as np

from tieflax.sharding import make_mesh

# Every feature at once, and none.
ALL = dict(z_loss=1e-2, label_smoothing=0.1, logit_scale=0.7, softcap=5.0)
PLAIN = dict(z_loss=0.0, label_smoothing=0.0, logit_scale=1.0, softcap=None)
# name -> (data, fsdp, tensor) over the first data*fsdp*tensor devices; None = single-device path.
# 'fsdp' > 1 shards W's d as the model does (P('tensor', 'fsdp')): blockwise gather, dW reduce-scatter.
MESHES = {"1dev": None, "2dev_1x2": (1, 1, 2), "4dev_2x2": (2, 1, 2), "8dev_1x8": (1, 1, 8),
          "8dev_2x4": (2, 1, 4), "8dev_8x1": (8, 1, 1), "8dev_f2x4": (1, 2, 4)}


def mesh_named(name):
    """The mesh ``MESHES[name]`` names, or None for the single-device path."""
    shape = MESHES[name]
    return None if shape is None else make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])


def close(got, want, rel):
    """``got`` within ``rel`` of the largest magnitude of ``want`` (float64), element by element."""
    want = np.asarray(want, np.float64)
    if not want.size:
        return
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=rel * max(np.abs(want).max(), 1e-30))
