"""Llama-3.2-1B, Meta 2024: GQA 32/8, RoPE theta 500k with llama3 scaling (factor 32); tied.

Published shapes; 1,235,814,400 parameters as published, which `tieflax params` reproduces exactly:

    tieflax params --config configs/models/llama3_2_1b.py

Flip the tie switch and nothing else with `--config.model.tie_embeddings=False` (or True).

With the pod defaults below (bf16 compute, fp32 parameters and Adam, FSDP over all chips, scanned
layers, remat 'full'), one 8,192-token sequence per chip fits
v5e:2x4 with 71% of each chip's HBM left tied, 69% untied (benchmarks/README.md,
"Fits at pod scale"):

    tieflax plan --config configs/models/llama3_2_1b.py --topology v5e:2x4 --config.train.seq_len=8192 --tie both
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family='llama',
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_len=8192,
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
