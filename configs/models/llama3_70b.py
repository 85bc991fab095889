"""Llama-3-70B, Meta 2024: GQA 64/8, RoPE theta 500k; untied.

Published shapes; 70,553,706,496 parameters as published, which `tieflax params` reproduces exactly:

    tieflax params --config configs/models/llama3_70b.py

Flip the tie switch and nothing else with `--config.model.tie_embeddings=False` (or True).

With the pod defaults below (bf16 compute, fp32 parameters and Adam, FSDP over all chips, scanned
layers, remat 'full'), one 8,192-token sequence per chip fits
v5p:8x8x8 with 79% of each chip's HBM left tied and untied (benchmarks/README.md,
"Fits at pod scale"):

    tieflax plan --config configs/models/llama3_70b.py --topology v5p:8x8x8 --config.train.seq_len=8192 --tie both
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family='llama',
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
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
