"""Every default of training (optimiser, schedule, loss, checkpoints, logging), in one place.

The experiment config holds this as ``config.train``. Model numerics live in ``config.model``: bf16
compute with fp32 parameters is ``model.dtype='bfloat16'`` (``model.param_dtype`` stays ``'float32'``).
The mesh is ``config.mesh``; the data pipeline is ``config.data``.
"""

from __future__ import annotations

import ml_collections


def default_train_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seq_len = 128
    c.global_batch_size = 16          # sequences per optimiser step, across all processes
    c.grad_accum_steps = 1            # micro-batches per step (global_batch_size must divide)
    c.num_steps = 1000
    c.learning_rate = 3e-3
    c.warmup_steps = 100
    c.min_lr_ratio = 0.1              # cosine decays to learning_rate * min_lr_ratio
    c.adam_b1 = 0.9
    c.adam_b2 = 0.95
    c.adam_eps = 1e-8
    c.weight_decay = 0.1
    c.decay_embeddings = False        # apply weight decay to embedding / head matrices
    c.embedding_optimizer = "adam"    # 'adam', or 'sgd': SGD + momentum 0.9 on embedding matrices (ablation)
    c.embedding_sgd_lr = 1.0          # peak rate of that SGD (same warmup and cosine as learning_rate)
    c.decay_norms_and_biases = False
    c.grad_clip_norm = 1.0
    c.z_loss = 0.0
    c.label_smoothing = 0.0
    c.loss_impl = "fused"             # 'fused' (blockwise, no logits) or 'dense' (full logits: baseline)
    # Fused cross-entropy tile [token block x vocab block]: the cross-entropy sweep's fastest CPU setting
    # (benchmarks/README.md); the tile is 8 MiB of fp32 logits whatever the vocabulary size.
    c.loss_token_block = 8192
    c.loss_vocab_block = 256
    c.eval_every = 200
    c.eval_batches = 8
    c.log_every = 10
    c.checkpoint_every = 200
    c.keep_checkpoints = 3
    c.analyze_every = 0               # diagnostics interval in steps; 0 = off
    return c
