"""The tied-vs-untied study on this machine: three small Llama-style LMs on the King James Bible.

    tieflax compare --config configs/experiments/tie_vs_untie.py --workdir runs/compare

Trains ``tied``, ``untied`` (same body, its own 8,192 x 128 head: +1,048,576 parameters) and
``untied_matched`` (untied at the tied model's total parameter count: d_model 128 -> 88, d_ff solved to
match within 0.1%) for the same 200 steps x 16 x 128 tokens (409,600 tokens), seed 0, then analyses their checkpoints and
writes ``runs/compare/report.md`` (+ ``report.html`` and PNGs). Expect about 10 minutes on 2 CPU cores;
the last lines printed are the report's path. Rerunning resumes; ``--report-only`` rewrites the report.

Knobs: ``--config.compare.seeds='(0, 1, 2)'`` (mean and spread; x3 time), ``--config.compare.match=depth``
(needs a deeper body: 4 layers cannot absorb a 1M-parameter head), ``--config.train.num_steps=N``.
"""

import os

from tieflax.analysis.study import default_compare_config
from tieflax.config import load_config


def get_config(arg: str = ""):
    # The model, data and batch shape are the tiny experiment's, so the study and `tieflax train` on
    # configs/experiments/tiny.py train the same tied model; each variant sets the tie switch itself.
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py"))
    t = config.train
    t.num_steps = 200
    t.warmup_steps = 20
    t.learning_rate = 3e-3
    t.eval_every = 50
    t.eval_batches = 8
    t.log_every = 10
    t.analyze_every = 25          # diag/* rows in metrics.jsonl (parameter diagnostics over training)
    config.compare = default_compare_config()
    config.compare.analysis_points = 4
    if arg == "smoke":
        # Seconds, not minutes: a shape check of the whole pipeline (the numbers mean nothing).
        config.model.update(d_model=32, n_layers=1, n_heads=2, d_ff=64)
        t.update(num_steps=8, global_batch_size=8, seq_len=32, eval_every=8, eval_batches=1, log_every=2,
                 analyze_every=4, warmup_steps=2)
        config.compare.analysis_points = 2
        config.compare.val_batches = 1
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use '' or 'smoke'")
    return config
