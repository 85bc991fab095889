"""notebooks/01_quickstart.ipynb: a tied and an untied model, their parameters, a short training each."""

INTRO = r'''
# tieflax quickstart: one switch, two models

Should the input embedding and the output head of a language model share one matrix? In tieflax that is
`config.model.tie_embeddings` and nothing else: a tied model's head reads the embedding's parameter
(`nn.share_scope`), an untied model's head owns a matrix of the same name, shape and orientation. Every
other knob stays put, so a comparison of the two has no hidden confound.

This notebook builds both variants of a small Llama-style model, counts their parameters exactly, trains
each briefly on the corpus that ships with tieflax (the King James Bible, read offline) and plots the two
loss curves.
'''

CELLS = [
    ("code", r'''
# Settings. The defaults train two tiny models for 20 steps each (a minute or so on a 2-core CPU).
# For a real run use the shapes of configs/experiments/tiny.py: VOCAB = 8192, D_MODEL = 128, N_LAYERS = 4,
# SEQ_LEN = 128, STEPS = 600, and a fresh WORKDIR.
STEPS = 20            # optimiser steps per model
VOCAB = 2048          # BPE vocabulary V, trained on the corpus on the first run
D_MODEL = 64          # width d: each embedding matrix is V x d
N_LAYERS = 2
SEQ_LEN = 64
BATCH = 16            # sequences per step
WORKDIR = "runs/quickstart"  # rerunning the notebook resumes from here; delete it to start over
'''),
    ("code", r'''
import os

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from tieflax.model.params import abstract_params, format_table, param_report
from tieflax.config import default_config, default_model_config, model_config
from tieflax.run.metrics import read_metrics
from tieflax.train import train_and_evaluate
'''),
    ("md", r'''
## 1. The configuration and the tie switch

A tieflax experiment is an `ml_collections.ConfigDict` built on `default_config()`, where every default
lives (`config.model`, `config.data`, `config.train`, `config.mesh`). `model_config(config)` validates
the model section into a frozen `ModelConfig`. The two variants differ in one field.
'''),
    ("code", r'''
def make_config(tied: bool):
    config = default_config()
    config.model = default_model_config(family="llama", vocab_size=VOCAB, d_model=D_MODEL, n_layers=N_LAYERS,
                                        n_heads=4, d_ff=4 * D_MODEL, max_seq_len=SEQ_LEN, tie_embeddings=tied)
    config.data.tokenizer.vocab_size = VOCAB    # the BPE trained on the corpus must match the model's V
    t = config.train
    t.seq_len, t.global_batch_size, t.num_steps = SEQ_LEN, BATCH, STEPS
    t.warmup_steps = max(1, STEPS // 10)
    t.log_every = max(1, STEPS // 10)
    t.eval_every = max(1, STEPS // 3)           # a few validation points for the plot
    t.eval_batches = 2
    t.checkpoint_every = STEPS
    config.mesh.data = -1                       # all devices split the batch
    return config


configs = {"tied": make_config(True), "untied": make_config(False)}
for name, config in configs.items():
    params = abstract_params(model_config(config))  # shapes only: jax.eval_shape, nothing allocated
    heads = {k: tuple(v["embedding"].value.shape) for k, v in params.items() if k in ("embed", "lm_head")}
    print(f"{name:7s} embedding matrices [V_pad, d]: {heads}")
'''),
    ("md", r'''
The tied tree has one `embed/embedding`; the untied tree adds `lm_head/embedding` of the same shape.
`V_pad` rounds `V` up to a multiple of `vocab_pad_multiple` (128) so the vocabulary splits evenly over
devices; padded rows are never counted as parameters, so the two totals differ by exactly `V x d`:
'''),
    ("code", r'''
reports = [param_report(model_config(config), name) for name, config in configs.items()]
display(Markdown(format_table(reports)))
extra = reports[1].total - reports[0].total
assert extra == VOCAB * D_MODEL, (extra, VOCAB * D_MODEL)
print(f"untied - tied = {extra:,} parameters = V x d = {VOCAB:,} x {D_MODEL}")
'''),
    ("md", r'''
At this size the one matrix is half of the tied model and the two are two thirds of the untied one,
which is why small models usually tie. Run
`tieflax params` in a terminal for the same table over ten published models (GPT-2 to Llama-3-70B).

## 2. Train both

`train_and_evaluate(config, workdir)` prepares the data (the first run trains the BPE tokenizer and
caches the token ids), lays parameters and batches out on a `(data, fsdp, tensor)` mesh of all devices,
trains with the fused cross-entropy, checkpoints with orbax and logs to `workdir/metrics/`. The
untied run reuses the tied run's tokenizer and token cache, so both see exactly the same data.
'''),
    ("code", r'''
results = {}
for name, config in configs.items():
    if name != "tied":  # same tokenizer and token cache as the first run
        config.data.tokenizer.path = os.path.join(WORKDIR, "tied", "tokenizer.json")
    config.data.cache_dir = os.path.join(WORKDIR, "data_cache")
    results[name] = train_and_evaluate(config, os.path.join(WORKDIR, name))
    r = results[name]
    print(f"{name:7s} step {r['step']}: validation loss {r['final_val_loss']:.3f} "
          f"(perplexity {r['final_val_perplexity']:.1f}), {r['params']['total']:,} parameters")
'''),
    ("md", r'''
## 3. Loss curves

Every run logs to `metrics/` (JSON-lines segments, one per log period: `split`, `step` and the
metrics), which `tieflax.run.metrics.read_metrics` reads back as one stream.
'''),
    ("code", r'''
fig, ax = plt.subplots(figsize=(7, 4))
for name, color in (("tied", "tab:blue"), ("untied", "tab:orange")):
    train = read_metrics(results[name]["workdir"], split="train")
    val = read_metrics(results[name]["workdir"], split="val")
    ax.plot([r["step"] for r in train], [r["ce_loss"] for r in train], color=color, label=f"{name} train")
    ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o--", color=color, label=f"{name} val")
ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=f"V={VOCAB}, d={D_MODEL}, {STEPS} steps")
ax.grid(alpha=0.3)
ax.legend()
plt.show()
'''),
    ("md", r'''
Both curves start near `ln V` (a uniform guess) and fall together. A run this short says nothing about
which variant is better: differences this early are within seed-to-seed noise. For the real study,
with several seeds, a parameter-matched untied model and the embedding diagnostics, see
`03_embedding_geometry.ipynb` and `tieflax compare`.
'''),
]
