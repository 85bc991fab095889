"""The run's home: everything a run directory holds and every rule about it.

    run            the Run: a run directory opened once for writing (location resolved and checked, lease
                   held, identity checked), owning checkpoints, metrics, trackers, profiler and console
    read_only      the same directory opened for reading (``Run.read``): evaluate, sample, val-loss, analyze
    layout         every name in a run directory, once; what counts as a run; where a run may live (RunDir:
                   the location resolved and checked once, handed to every part in place of the string)
    identity       which fields make the run the run it is, and what a resume must match
    record         the record's files (config.json, data.json, config_history/) and their digest chain
    saved_config   config.json written once, and the config in force read back
    lock           one writer at a time (a lease with a heartbeat on gs:// and s3://)
    destinations   where convert and surgery may write a new run, which appears whole or not at all
    checkpoints    orbax checkpoints: the manager, restore onto any mesh, damaged ones set aside
    save_watch     the background saves, and a failed one turned into an error at the next step
    orbax_handlers the checkpoint items' handlers (train state, data position)
    metrics        metric segments and TensorBoard events

No other module builds a path inside a run directory: they ask these.
"""
