"""The run's home: everything a run directory holds and every rule about it.

    run            the Run: a run directory opened once for writing (location resolved and checked, lease
                   held, identity checked), owning checkpoints, metrics, trackers, profiler and console
    layout         every name in a run directory, once; what counts as a run; where a run may live
    identity       the run's config (created once) and what a resume must match
    lock           one writer at a time (a lease with a heartbeat on gs:// and s3://)
    destinations   where convert and surgery may write a new run, which appears whole or not at all
    checkpoints    orbax checkpoints: save, restore onto any mesh, damaged ones set aside
    metrics        metric segments and TensorBoard events

No other module builds a path inside a run directory: they ask these.
"""
