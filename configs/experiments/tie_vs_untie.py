"""The tied-vs-untied study on this machine: small Llama-style LMs on the King James Bible, 3 paired seeds.

    tieflax compare --config configs/experiments/tie_vs_untie.py --workdir runs/compare

Trains, for seeds 0, 1 and 2 (a seed fixes the init key and the data order of every variant):
``tied``; ``untied`` (same body, its own 8,192 x 64 head: +524,288 parameters, equal non-embedding
parameters); ``untied_matched`` (Chung et al.: the same body, untied embeddings of width E = 32 with
projections to and from d_model, at the tied model's total +0.6%). Each run is 250 steps x 16 x 128
tokens (512,000 tokens, 0.55 epochs of the train split). Then it measures every run against its
initialisation and writes ``runs/compare/report.md`` (+ ``report.html`` and PNGs) with paired 95%
bootstrap intervals. See README.md ("The study") for the measured time. Rerunning resumes;
``--report-only`` rewrites the report.

The model is tiny.py's narrowed to d_model 64 and 2 layers so that 3 seeds x 3 variants fit the time of
one variant at d_model 128. Knobs: ``--config.compare.seeds='(0, 1, 2, 3, 4)'``,
``--config.compare.variants='("tied", "untied", "untied_matched", "untied_width", "tied_embed_decay")'``
(every name: ``tieflax.study.compare.VARIANTS``), ``--config.train.num_steps=N``; benchmark tasks per
run, off here: ``--config.compare.tasks="('arc_easy',)"`` (lm-eval names; ``compare.task_include_path``,
``task_limit``, ``task_num_fewshot``: see README "The study"). ``untied_depth``
needs a deeper body (2 layers cannot absorb a 0.5M-parameter head).
"""

import os

from tieflax.study.compare import default_compare_config
from tieflax.config import load_config


def get_config(arg: str = ""):
    # The data and batch shape are the tiny experiment's; each variant sets the tie switch itself.
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))
    config.model.update(d_model=64, n_layers=2, n_heads=4, d_ff=256)
    t = config.train
    t.num_steps = 250
    t.warmup_steps = 25
    t.learning_rate = 3e-3
    t.eval_every = 250
    t.eval_batches = 4            # the trainer's quick check; the study evaluates on the whole split
    t.log_every = 10
    t.analyze_every = 0           # the study measures checkpoints instead
    config.compare = default_compare_config()
    config.compare.analysis_points = 5   # checkpoints at 50, 100, ..., 250: the rare-token gains through training
    if arg == "smoke":
        # Seconds, not minutes: a shape check of the whole pipeline (the numbers mean nothing).
        config.model.update(d_model=32, n_layers=1, n_heads=2, d_ff=64)
        t.update(num_steps=8, global_batch_size=8, seq_len=32, eval_every=8, eval_batches=1, log_every=2,
                 warmup_steps=2)
        config.compare.update(seeds=(0, 1), val_batches=4, grad_batches=2)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use '' or 'smoke'")
    return config
