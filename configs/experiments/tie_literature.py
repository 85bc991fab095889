"""This year's claims about tying, answered on this machine: the "From the literature" table resolved.

    tieflax compare --config configs/experiments/tie_literature.py --workdir runs/literature

The main study's model and budget (``tie_vs_untie.py``: d_model 64, 2 layers, 250 steps x 16 x 128
tokens on the King James Bible), with

- the intervention variant ``tied_input_grad_scaled`` (Lopardo et al., arXiv 2603.26663: the lookup
  path's gradient into the tied matrix x ``compare.input_grad_scale`` = 5 during training, through
  ``train.tied_input_grad_scale``) beside ``tied`` and ``untied`` (``untied_matched`` is left out: the
  claims are about tying, at the same body);
- 5 paired seeds instead of 3 (a percentile bootstrap over 3 seeds has 10 distinct means), so intervals
  over seeds resolve; seeds 0-2 of ``tied`` and ``untied`` are exactly the main study's runs;
- the tuned lens scored on every document of the held-out split's second half (the main study scores
  about 8,192 tokens of it, to stay within its time).

15 runs; see README.md ("The study") for the measured time and the table it gives.
Knobs: ``--config.compare.input_grad_scale=2.0``, ``--config.compare.seeds='(0, 1, 2, 3, 4, 5)'``.
"""

import os

from tieflax.config import load_config


def get_config(arg: str = ""):
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tie_vs_untie.py"))
    config.compare.variants = ("tied", "untied", "tied_input_grad_scaled")
    config.compare.seeds = (0, 1, 2, 3, 4)
    config.compare.input_grad_scale = 5.0
    config.compare.lens_score_tokens = 0      # the whole second half of the held-out documents
    if arg == "smoke":
        # Seconds: the shape of the whole pipeline (the numbers mean nothing).
        config.model.update(d_model=32, n_layers=1, n_heads=2, d_ff=64)
        config.train.update(num_steps=8, global_batch_size=8, seq_len=32, eval_every=8, eval_batches=1,
                            log_every=2, warmup_steps=2)
        config.compare.update(seeds=(0, 1), val_batches=4, grad_batches=2)
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use '' or 'smoke'")
    return config
