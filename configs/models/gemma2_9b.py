"""Gemma-2-9B, Google 2024: GQA 16/8 (head_dim 256), sandwich norms, attention soft-cap 50, final
logit soft-cap 30, local/global attention (window 4096 on even layers), query scale 1/sqrt(256); tied.

Published shapes; 9,241,705,984 parameters as published, which `tieflax params` reproduces exactly:

    tieflax params --config configs/models/gemma2_9b.py

Flip the tie switch and nothing else with `--config.model.tie_embeddings=False` (or True).

With the pod defaults below (bf16 compute, fp32 parameters and Adam, FSDP over all chips, scanned
layers, remat 'full'), one 8,192-token sequence per chip fits
v5p:4x4x4 with 91% of each chip's HBM left tied and untied (benchmarks/README.md,
"Fits at pod scale"):

    tieflax plan --config configs/models/gemma2_9b.py --topology v5p:4x4x4 --config.train.seq_len=8192 --tie both
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family='gemma2',
        vocab_size=256000,
        d_model=3584,
        n_layers=42,
        n_heads=16,
        n_kv_heads=8,
        head_dim=256,
        d_ff=14336,
        max_seq_len=8192,
        norm_eps=1e-06,
        norm_unit_offset=True,
        sandwich_norms=True,
        mlp='geglu',
        scale_input_embedding=True,
        attn_softcap=50.0,
        final_logit_softcap=30.0,
        query_pre_attn_scalar=256.0,
        sliding_window=4096,
        sliding_window_every=2,
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
