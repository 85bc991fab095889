"""Tied vs untied across sizes on this machine: the loss-vs-parameters curves and where they cross.

    tieflax sweep --config configs/experiments/tie_scaling.py --workdir runs/sweep [--resume]

Four sizes (d_model 32-96, 1-3 layers, vocabulary 8,192: the embedding share falls from 89% to 57% of a
tied model), variants ``tied``, ``untied`` (same body), ``untied_matched`` (same body, narrower untied
embeddings, equal total) and ``untied_width`` (narrower body, equal total), 2 seeds each, 150 steps x 16 x
128 tokens per run. Each variant's learning rate is the best of (3e-3, 1e-2, 3e-2) at size 1 (seed 0): a
first run with (1e-3, 3e-3, 1e-2) found 1e-2 best for tied, untied and untied_matched, the grid's edge.
See README.md ("The study") for the measured time. ``:smoke`` is a minutes-long shape check of the whole
command (2 tiny sizes, 4 steps). ``:pod`` is the top of the curve: three sizes up to the Llama-3.2-1B
shape on the pod study's data and mesh (``tie_vs_untie_pod.py``; pass its data paths the same way).
"""

import os

from tieflax.study.compare import default_compare_config
from tieflax.study.sweep import default_sweep_config
from tieflax.config import load_config


def get_config(arg: str = ""):
    here = os.path.dirname(os.path.abspath(__file__))
    if arg == "pod":
        config = load_config(os.path.join(here, "tie_vs_untie_pod.py"))
        config.train.update(num_steps=5_000, warmup_steps=500, eval_batches=32)
        config.sweep = default_sweep_config()
        config.sweep.update(sizes=((512, 8, 2048, 8), (1024, 12, 4096, 16), (2048, 16, 8192, 32)),
                            seeds=(0, 1, 2), lrs=(1e-4, 3e-4, 1e-3), lr_size=0)
        return config
    config = load_config(os.path.join(here, "tiny.py"))
    t = config.train
    t.num_steps = 150
    t.warmup_steps = 15
    t.log_every = 10
    t.analyze_every = 0
    config.sweep = default_sweep_config()
    config.compare = default_compare_config()   # only its benchmark tasks apply: --config.compare.tasks=...
    if arg == "smoke":
        config.sweep.update(sizes=((16, 1, 32, 2), (32, 1, 64, 2)), variants=("tied", "untied", "untied_matched"),
                            lrs=(3e-3, 1e-2), lr_size=0, bootstrap=200)
        t.update(num_steps=4, global_batch_size=8, seq_len=32, warmup_steps=1, log_every=2)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use '' (the default), 'smoke' or 'pod'")
    return config
