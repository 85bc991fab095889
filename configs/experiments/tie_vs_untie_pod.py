"""The tied-vs-untied study at scale: ~1B-parameter Llama-style models, 128k vocabulary, pre-tokenised data.

Data step, once, on any machine (or several: add --shard i/N to each, then run once with --finalize):
tokenise the corpus onto the bucket with Llama-3's tokenizer into a token store::

    tieflax prepare --config configs/experiments/tie_vs_untie_pod.py --out gs://BUCKET/stores/llama3_corpus \
        --config.data.source=files --config.data.files.paths='gs://BUCKET/text/*.jsonl' \
        --config.data.tokenizer.path=gs://BUCKET/tokenizers/llama3/tokenizer.json --workers 32

then, on every worker of a TPU pod slice (see launch/), compare on it; each host reads only the windows
of its own rows::

    tieflax compare --config configs/experiments/tie_vs_untie_pod.py --workdir gs://BUCKET/runs/tie_vs_untie \
        --config.data.tokens.path=gs://BUCKET/stores/llama3_corpus

The same two steps at CPU scale (the ``:runlocal`` variant: the King James Bible, a trained 8,192-token
BPE; a few minutes on 2 cores)::

    tieflax prepare --config configs/experiments/tie_vs_untie_pod.py:runlocal --out /tmp/pod_store --workers 2
    tieflax compare --config configs/experiments/tie_vs_untie_pod.py:runlocal --workdir /tmp/pod_runlocal \
        --config.data.source=tokens --config.data.tokens.path=/tmp/pod_store

Token files made elsewhere also work: ``--config.data.tokens.train_path=/data/train.bin
--config.data.tokens.val_path=/data/val.bin --config.data.tokenizer.path=/data/tokenizer.json``.

Same three variants as ``tie_vs_untie.py``: ``tied`` (Llama-3.2-1B shape: d 2048, 16 layers, V 128,256,
tied as published), ``untied`` (+262,668,288 parameters, equal body) and ``untied_matched`` (the same
body, untied embeddings of a narrower width projected to d_model, at the tied total). Each run: 20,000
steps x 512 x 2048 tokens = 21B tokens, three seeds.
The vocabulary is sharded over ``tensor`` (4) and parameters over ``fsdp``; the fused loss never builds
logits. Diagnostics sample 4,096 rows for pairwise and spectral statistics, and the trainer logs them every
1,000 steps. ``:runlocal`` shrinks everything to a CPU smoke test of the same code path.
"""

from tieflax.study.compare import default_compare_config
from tieflax.config import default_config, default_model_config


def get_config(arg: str = ""):
    config = default_config()
    config.model = default_model_config(
        family="llama", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
        d_ff=8192, max_seq_len=2048, rope_theta=500000.0, rope_scaling_factor=32.0,
        rope_original_max_len=8192, norm_eps=1e-5, tie_embeddings=True, dtype="bfloat16",
        param_dtype="float32", remat=True)
    config.data.source = "tokens"
    config.data.tokens.dtype = "uint32"
    config.data.tokenizer.eos_token = "<|end_of_text|>"
    config.mesh.update(data=-1, fsdp=8, tensor=4)
    t = config.train
    t.seq_len = 2048
    t.global_batch_size = 512
    t.num_steps = 20_000
    t.warmup_steps = 2_000
    t.learning_rate = 3e-4
    t.eval_every = 1_000
    t.eval_batches = 32
    t.log_every = 50
    t.checkpoint_every = 2_000
    t.keep_checkpoints = 11
    t.analyze_every = 1_000
    config.compare = default_compare_config()
    config.compare.seeds = (0, 1, 2)
    config.compare.analysis_points = 10
    config.compare.val_batches = 0   # the whole held-out split
    config.compare.max_rows = 4096
    if arg == "runlocal":
        config.model.update(vocab_size=8192, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                            d_ff=256, max_seq_len=128, rope_scaling_factor=0.0, dtype="float32", remat="none")
        config.data.source = "kjv"
        config.data.tokenizer.eos_token = "<|endoftext|>"
        config.mesh.update(data=-1, fsdp=1, tensor=1)
        t.update(seq_len=64, global_batch_size=8, num_steps=20, warmup_steps=2, eval_every=10, eval_batches=2,
                 log_every=5, checkpoint_every=10, keep_checkpoints=3, analyze_every=10)
        config.compare.seeds = (0,)
        config.compare.analysis_points = 2
        config.compare.val_batches = 1
        config.compare.max_rows = 1024
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use '' or 'runlocal'")
    return config
