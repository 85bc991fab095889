"""Tied vs untied across sizes on this machine: the loss-vs-parameters curves and where they cross.

    tieflax sweep --config configs/experiments/tie_scaling.py --workdir runs/sweep [--resume]

Four sizes (d_model 32-96, 1-3 layers, vocabulary 8,192: the embedding share falls from 89% to 57% of a
tied model), variants ``tied``, ``untied`` (same body), ``untied_matched`` (same body, narrower untied
embeddings, equal total) and ``untied_width`` (narrower body, equal total), 2 seeds each, 150 steps x 16 x
128 tokens per run. Each variant's learning rate is the best of (1e-3, 3e-3, 1e-2) at size 1 (seed 0).
See README.md ("The study") for the measured time. ``:smoke`` is a seconds-long shape check.
"""

import os

from tieflax.analysis.sweep import default_sweep_config
from tieflax.config import load_config


def get_config(arg: str = ""):
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))
    t = config.train
    t.num_steps = 150
    t.warmup_steps = 15
    t.log_every = 10
    t.analyze_every = 0
    config.sweep = default_sweep_config()
    if arg == "smoke":
        config.sweep.update(sizes=((16, 1, 32, 2), (32, 1, 64, 2)), variants=("tied", "untied", "untied_matched"),
                            lrs=(3e-3, 1e-2), lr_size=0, bootstrap=200)
        t.update(num_steps=4, global_batch_size=8, seq_len=32, warmup_steps=1, log_every=2)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use '' or 'smoke'")
    return config
