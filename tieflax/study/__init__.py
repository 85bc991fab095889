"""The study: ``tieflax compare`` and ``tieflax sweep`` train paired tied/untied runs, measure them and
report paired intervals. The orchestration lives here; the pure measures it applies are in
``tieflax.analysis``.

    compare    the variants, their training and analysis, the study's resume
    sweep      tied vs untied across model sizes, each at its own best learning rate
    evidence   everything measured on one trained run (final against initial parameters)
    analyze    diagnostics of any checkpoint of a run (``tieflax analyze``)
    tasks      benchmark tasks (lm-eval) scored on each run, paired per task
    report     report.md / report.html and the plots
    literature the "From the literature" table and its detail (this year's papers' claims, measured)
    findings   a finding and its verdict word, both computed from one interval
    provenance the command, commit, date and compute time of a study's runs, kept across reruns
    resume     a run in the study's workdir is reused only if trained with the same result fields
"""
