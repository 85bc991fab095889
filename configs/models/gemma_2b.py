"""Gemma-2B, Google 2024: multi-query attention (8 heads, 1 KV head, head_dim 256), GeGLU,
RMSNorm (1+w), input x sqrt(d); tied.

Published shapes; 2,506,172,416 parameters as published, which `tieflax params` reproduces exactly:

    tieflax params --config configs/models/gemma_2b.py

Flip the tie switch and nothing else with `--config.model.tie_embeddings=False` (or True).

With the pod defaults below (bf16 compute, fp32 parameters and Adam, FSDP over all chips, scanned
layers, remat 'full'), one 8,192-token sequence per chip fits
v5e:2x4 with 50% of each chip's HBM left tied, 45% untied (benchmarks/README.md,
"Fits at pod scale"):

    tieflax plan --config configs/models/gemma_2b.py --topology v5e:2x4 --config.train.seq_len=8192 --tie both
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family='gemma',
        vocab_size=256000,
        d_model=2048,
        n_layers=18,
        n_heads=8,
        n_kv_heads=1,
        head_dim=256,
        d_ff=16384,
        max_seq_len=8192,
        norm_eps=1e-06,
        norm_unit_offset=True,
        mlp='geglu',
        scale_input_embedding=True,
        rope_theta=10000.0,
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
