"""SmolLM-135M, Hugging Face 2024: Llama architecture, GQA 9/3 heads; tied.

Published shapes; 134,515,008 parameters as published, which `tieflax params` reproduces exactly:

    tieflax params --config configs/models/smollm_135m.py

Flip the tie switch and nothing else with `--config.model.tie_embeddings=False` (or True).
"""

from tieflax.config import default_config, default_model_config


def get_config():
    config = default_config()
    config.model = default_model_config(
        family='llama',
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        max_seq_len=2048,
        norm_eps=1e-05,
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
