"""Qwen2.5-7B, Alibaba 2024: GQA 28/4, q/k/v biases, RoPE theta 1M; untied.

Published shapes; 7,615,616,512 parameters as published, which `tieflax params` reproduces exactly:

    tieflax params --config configs/models/qwen2_5_7b.py

Flip the tie switch and nothing else with `--config.model.tie_embeddings=False` (or True).
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family='qwen2',
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        d_ff=18944,
        max_seq_len=32768,
        norm_eps=1e-06,
        qkv_bias=True,
        rope_theta=1000000.0,
        tie_embeddings=False,
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
