"""Helpers for the tests that run lm-evaluation-harness in the test's own process (a helper module, not a test
file): ``no_torch_env_report``.

Used by tests/test_compare_tasks.py, test_eval_harness.py and test_train_observers.py."""

from __future__ import annotations

import contextlib

NOT_COLLECTED = "not collected in the tests (tests/lm_eval_support.py)"


@contextlib.contextmanager
def no_torch_env_report():
    """While open, lm-eval's scoring (``simple_evaluate``) puts a fixed line where its results' metadata
    holds torch's environment report (``pretty_env_info``, ``torch.utils.collect_env``: ``pip list`` in a
    new interpreter and some ten shell commands, nvidia-smi, lscpu, conda list, ...): 0.53 CPU-s of child
    processes each time lm-eval scores, where torch is installed (measured on the 3.11 stack, 2026-12-07).
    No test reads that report; everything else lm-eval computes and records (the scores, the samples, the
    other metadata) is as before. Where torch is not installed lm-eval reports none anyway."""
    from lm_eval import evaluator

    real = evaluator.add_env_info

    def add_env_info(storage):
        from lm_eval.utils import is_torch_available

        if not is_torch_available():
            return real(storage)
        from torch.utils import collect_env

        report = collect_env.get_pretty_env_info
        collect_env.get_pretty_env_info = lambda: NOT_COLLECTED
        try:
            return real(storage)
        finally:
            collect_env.get_pretty_env_info = report

    evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        evaluator.add_env_info = real
