"""GPT-2 (124M), OpenAI 2019: learned positions, LayerNorm, GELU MLP, biases everywhere; tied.

Published shapes; 124,439,808 parameters as published, which `tieflax params` reproduces exactly:

    tieflax params --config configs/models/gpt2.py

Flip the tie switch and nothing else with `--config.model.tie_embeddings=False` (or True).
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family='gpt2',
        vocab_size=50257,
        d_model=768,
        n_layers=12,
        n_heads=12,
        d_ff=3072,
        max_seq_len=1024,
        norm='layernorm',
        mlp='gelu',
        mlp_bias=True,
        qkv_bias=True,
        attn_out_bias=True,
        position='learned',
        tie_embeddings=True,
        dtype='bfloat16',    # pod defaults: bf16 compute, fp32 parameters and Adam state
        param_dtype='float32',
        scan_layers=True,    # one compiled layer, stacked params
        remat='full',        # the least memory; see benchmarks/README.md for the others
        mlp_chunk=1024,      # the MLP 1024 tokens at a time: a long sequence's widest activations shrink
    )
    # FSDP over all chips (MaxText's default mesh): parameters and Adam state sharded, gathered a layer
    # at a time by the scan. Pure data parallelism would replicate them on every chip.
    config.mesh.update(data=1, fsdp=-1, tensor=1)
    return config
