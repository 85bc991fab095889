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
# enough to see what every plot shows, far too little to judge a claim. With one seed there are no
# intervals: every verdict reads "unresolved". For a real run use configs/experiments/tie_vs_untie.py's
# shapes: VOCAB = 8192, D_MODEL = 64, N_LAYERS = 2, SEQ_LEN = 128, STEPS = 250,
# VARIANTS = ("tied", "untied", "untied_matched"), SEEDS = (0, 1, 2), and a fresh WORKDIR.
STEPS = 20
VOCAB = 2048
D_MODEL = 64
N_LAYERS = 2
SEQ_LEN = 64
BATCH = 16
VARIANTS = ("tied", "untied")  # "untied_matched": same body, narrower untied embeddings, the tied total
SEEDS = (0,)
ANALYSIS_POINTS = 1            # checkpoints kept per run (the last is measured against the init)
WORKDIR = "runs/geometry"      # rerunning resumes finished runs; delete it to start over
'''),
    ("code", r'''
import os

from IPython.display import Image, Markdown, display

from tieflax.study.report import claims, diagnostics_table, results_table
from tieflax.study.compare import default_compare_config, run_compare
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
config.compare.update(variants=VARIANTS, seeds=SEEDS, analysis_points=ANALYSIS_POINTS, val_batches=4,
                      grad_batches=2)

summary = run_compare(config, WORKDIR)
groups = {v: [r for r in summary["runs"] if r["variant"] == v] for v in VARIANTS}
print("report:", summary["report"])
display(Markdown(results_table(groups)))
'''),
    ("md", r'''
## 2. The diagnostics, plot by plot

Frequency bins hold equal shares of the training tokens (rarest first), so the frequent head of the
vocabulary, where most text is, is resolved; padding rows are excluded everywhere. For the tied model the
"input" and "output" matrices are the same array. Every number is measured at the end of training and
against the same matrix at initialisation.
'''),
    ("code", r'''
CAPTIONS = {
    "loss_curves": "Training (thin) and validation (dashed) loss per variant, mean over seeds: the quality "
                   "side of the trade, judged at equal steps and tokens.",
    "norm_vs_frequency": "Mean row norm per equal-token-mass bin against the bin's log frequency (dotted: the "
                         "same matrix at init). A rising curve in the head is the frequency distortion; in a "
                         "tied model it is the input matrix too.",
    "movement_by_bin": "How far each bin's rows moved from their initial values: which rows training "
                       "actually changed (an untied input row moves only when its token occurs).",
    "anisotropy": "Anisotropy of unit-normalised rows per matrix (bars) against its value at init (x): mean "
                  "cosine, its unigram-weighted version, effective rank / d and the top component's share.",
    "gradient_interference": "The lookup and head gradients on held-out batches: the share of the first-order "
                             "loss change their cross term adds (below 0 = they interfere), raw and in Adam's "
                             "metric, with a row-shuffled control.",
    "updated_by_bin": "Fraction of rows whose gradient reaches 1% of a looked-up row's, by bin: the softmax "
                      "touches every row, but not every row appreciably.",
}
for name, caption in CAPTIONS.items():
    path = os.path.join(WORKDIR, f"{name}.png")
    assert os.path.exists(path), f"run_compare did not write {path}"
    display(Markdown(f"**{caption}**"), Image(filename=path))
'''),
    ("md", r'''
## 3. The numbers behind the plots, and the claims

`diagnostics_table` holds every geometry number (final, init, row-shuffled control, final minus init);
`claims` states each claim with the difference it is judged on and its 95% interval over seeds. A verdict
is only "the interval excludes 0" or "it does not"; with 20 steps and one seed nothing is resolved, which
is the honest answer at this budget.
'''),
    ("code", r'''
display(Markdown(diagnostics_table(groups)))
display(Markdown("\n".join(f"- {c}" for c in claims(groups, summary))))
'''),
    ("md", r'''
The full report, with the caveats of a run this size, is `WORKDIR/report.md`; `tieflax analyze
--workdir WORKDIR/<variant>/seed_0` gives any single checkpoint's diagnostics. For the real study run
`tieflax compare --config configs/experiments/tie_vs_untie.py --workdir runs/compare` (3 paired seeds of
three variants; README.md gives its measured time).
'''),
]
