"""The training job of tests/test_stop_together.py and tests/test_waits_bounded.py (a helper module, not a test
file): 2 processes x 1 CPU device over gloo, each started by the test, on one config.

One config for both files: their jobs compile the same programs, which every process writes to the suite's
cache (tests/every_process_caches), and read the same token files from the suite's data cache. The two files
run one after the other on one test worker (tests/conftest.py orders them; xdist starts each worker with two
files), so all but the first job of the pair find every program compiled: in one run of both files
(`-n0`, 3.11), the first job of test_stop_together took 14 CPU-s on a config of its own and 5-6 on this one.
"""

from __future__ import annotations

import os

from train_support import REPO

# tiny.py's model shrunk to a step of milliseconds (how processes stop or wait does not depend on its size),
# with the 512-token BPE that most of the suite's runs of tiny.py train on the same corpus (the suite's data
# cache holds it) instead of tiny.py's 8,192: a step of this model costs a tenth (the head and the loss over
# the vocabulary). A constant learning rate (no warmup, no decay): the compiled step does not depend on
# num_steps, so runs of any length use the same programs. One validation batch where a run evaluates (at its
# end, or at eval_every): the losses are not what is tested. The config's path is absolute: a process of
# tests/test_waits_bounded.py may run in another folder (its own copy of the code).
TRAIN = ["--config", os.path.join(REPO, "configs", "experiments", "tiny.py"), "--config.model.d_model=32",
         "--config.model.n_layers=1", "--config.model.n_heads=2", "--config.model.d_ff=64",
         "--config.model.max_seq_len=32", "--config.model.vocab_size=512", "--config.data.tokenizer.vocab_size=512",
         "--config.train.seq_len=32", "--config.train.global_batch_size=8", "--config.train.warmup_steps=0",
         "--config.train.min_lr_ratio=1.0", "--config.train.eval_batches=1"]
