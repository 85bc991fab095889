"""A CPU-sized Llama-style LM on the embedded King James Bible corpus (8,192-token BPE).

    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny
    tieflax train --config configs/experiments/tiny.py --workdir /tmp/tiny_untied \
        --config.model.tie_embeddings=False

4 layers, d_model 128, 4 heads, SwiGLU 512, sequences of 128 tokens, 16 per step. Tied by default, as
small models usually are; the untied variant adds exactly 8,192 x 128 = 1,048,576 parameters.
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family="llama",
        vocab_size=8192,
        d_model=128,
        n_layers=4,
        n_heads=4,
        d_ff=512,
        max_seq_len=128,
        tie_embeddings=True,
    )
    config.data.tokenizer.vocab_size = 8192
    config.train.seq_len = 128
    config.train.global_batch_size = 16
    config.train.num_steps = 600
    config.mesh.data = -1
    return config
