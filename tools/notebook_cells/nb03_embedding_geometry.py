"""notebooks/03_embedding_geometry.ipynb: the study's diagnostics on a short compare run."""

INTRO = r'''
# Embedding geometry: what tying does to the two matrices

The literature on tied embeddings makes a handful of testable claims: an output head's row norms track
token frequency; when the head *is* the input embedding, that distortion reaches the input; tying makes
the matrix more anisotropic; and the tied gradient adds a dense signal from the softmax (every row, every
step) to a sparse one from the lookup (rows of tokens in the batch), which may pull in different
directions. `tieflax compare` trains tied and untied variants on the same data and measures each claim.

This notebook runs a deliberately short comparison and explains each diagnostic plot in a sentence, so
that you can read the report of a real run.
'''

CELLS = [
    ("code", r'''
# Settings. The defaults train two tiny models for 20 steps each (a minute or two on a 2-core CPU):
# enough to see what every plot shows, far too little to judge a claim. For a real run use the shapes of
# configs/experiments/tie_vs_untie.py: VOCAB = 8192, D_MODEL = 128, N_LAYERS = 4, SEQ_LEN = 128,
# STEPS = 400, VARIANTS = ("tied", "untied", "untied_matched"), SEEDS = (0, 1, 2), and a fresh WORKDIR.
STEPS = 20
VOCAB = 2048
D_MODEL = 64
N_LAYERS = 2
SEQ_LEN = 64
BATCH = 16
VARIANTS = ("tied", "untied")  # "untied_matched": untied at the tied model's total parameter count
SEEDS = (0,)
ANALYSIS_POINTS = 2            # checkpoints analysed over training (plus the initialisation)
WORKDIR = "runs/geometry"      # rerunning resumes finished runs; delete it to start over
'''),
    ("code", r'''
import os

from IPython.display import Image, Markdown, display

from tieflax.analysis.report import claims, diagnostics_table, results_table
from tieflax.analysis.study import default_compare_config, run_compare
from tieflax.config import default_config, default_model_config
'''),
    ("md", r'''
## 1. A short comparison

The config is the one `tieflax compare` reads: a normal experiment config plus a `compare` section
(variants, seeds, how many checkpoints to analyse). `run_compare` prepares the data once, trains every
variant on the same tokenizer, token cache and batch order, analyses each run's checkpoints and writes
`report.md` with its plots into `WORKDIR`.
'''),
    ("code", r'''
config = default_config()
config.model = default_model_config(family="llama", vocab_size=VOCAB, d_model=D_MODEL, n_layers=N_LAYERS,
                                    n_heads=4, d_ff=4 * D_MODEL, max_seq_len=SEQ_LEN)
config.data.tokenizer.vocab_size = VOCAB
t = config.train
t.seq_len, t.global_batch_size, t.num_steps = SEQ_LEN, BATCH, STEPS
t.warmup_steps = max(1, STEPS // 10)
t.log_every = max(1, STEPS // 10)
t.eval_every = max(1, STEPS // 3)
t.eval_batches = 2
config.mesh.data = -1
config.compare = default_compare_config()
config.compare.update(variants=VARIANTS, seeds=SEEDS, analysis_points=ANALYSIS_POINTS, val_batches=1)

summary = run_compare(config, WORKDIR)
groups = {v: [r for r in summary["runs"] if r["variant"] == v] for v in VARIANTS}
print("report:", summary["report"])
display(Markdown(results_table(groups)))
'''),
    ("md", r'''
## 2. The diagnostics, plot by plot

Frequency buckets split the vocabulary into equal-size groups by training count, rarest first; padding
rows are excluded everywhere. For the tied model the "input" and "output" matrices are the same array.
'''),
    ("code", r'''
CAPTIONS = {
    "loss_curves": "Training (thin) and validation (dashed) loss per variant: the quality side of the "
                   "trade, judged at equal steps and tokens.",
    "norm_vs_frequency": "Each row's L2 norm against how often its token occurs: an upward trend (positive "
                         "Spearman rho) in the head is the frequency distortion, and in a tied model it "
                         "shows up in the input matrix too.",
    "norm_by_bucket": "The same trend averaged per frequency bucket, input and output matrix side by side.",
    "cosine_histograms": "Pairwise cosines between rows: an isotropic matrix centres on 0, mass to the "
                         "right means all rows lean one way (anisotropy).",
    "gradient_interference": "Over training, for one fixed batch: the per-row cosine between the lookup "
                             "and head gradients (below 0 = they conflict), the head's share of the "
                             "gradient, and the fraction of rows each path updates (head dense, lookup sparse).",
    "gradient_cosine_by_bucket": "That lookup-vs-head cosine per frequency bucket at the final checkpoint: "
                                 "where in the vocabulary the two signals agree or pull apart.",
    "softmax_mass_by_bucket": "Probability mass the model gives each bucket on validation text relative to "
                              "the bucket's unigram share: 1 is calibrated, above 1 over-predicts.",
}
for name, caption in CAPTIONS.items():
    path = os.path.join(WORKDIR, f"{name}.png")
    assert os.path.exists(path), f"run_compare did not write {path}"
    display(Markdown(f"**{caption}**"), Image(filename=path))
'''),
    ("md", r'''
## 3. The numbers behind the plots, and the claims

`diagnostics_table` holds every number at the final checkpoint; `claims` states each claim, the number it
is judged on, the threshold and what this run shows. With 20 steps and one seed, expect several to
read "not seen here", and none of them to settle anything: that is the honest answer at this budget.
'''),
    ("code", r'''
display(Markdown(diagnostics_table(groups)))
display(Markdown("\n".join(f"- {c}" for c in claims(groups))))
'''),
    ("md", r'''
The full report, with the caveats of a run this size, is `WORKDIR/report.md`; `tieflax analyze
--workdir WORKDIR/<variant>/seed_0` gives any single checkpoint's diagnostics. For the real study run
`tieflax compare --config configs/experiments/tie_vs_untie.py --workdir runs/compare` (about ten minutes
on two CPU cores, according to that config's docstring).
'''),
]
