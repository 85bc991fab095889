"""tieflax/hardware/gpu_flags.py: the GPU XLA flags are merged without overriding the user and only on a GPU
run. That XLA knows every flag, and that they reach a deviceless H100 compile, is checked in a fresh process
(XLA reads its flags once): tests/test_gpu_step.py."""

import pytest

from tieflax.errors import UserError
from tieflax.hardware import gpu_flags

ON = {gpu_flags.ENV: "recommended"}


def test_merge_keeps_the_users_own_setting_and_adds_the_rest():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d"
    merged, added = gpu_flags.merge(mine)
    assert merged.startswith(mine)  # the user's flags first, unchanged
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in merged
    assert [f.name for f in added] == [f.name for f in gpu_flags.RECOMMENDED[1:]]
    assert sorted(merged.split()) == sorted(set(merged.split()))  # no flag twice
    assert gpu_flags.merge(merged) == (merged, [])  # a second merge adds nothing


@pytest.mark.parametrize("environ", [
    {**ON, "JAX_PLATFORMS": "cpu"},
    {**ON, "JAX_PLATFORMS": "tpu,cpu"},
    {**ON, "CUDA_VISIBLE_DEVICES": "-1"},
])
def test_nothing_is_added_where_jax_runs_no_gpu(environ):
    environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    assert not gpu_flags.jax_uses_a_gpu(environ)
    assert gpu_flags.apply(environ) == []
    assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_on_a_gpu_only_the_choice_recommended_adds_flags(monkeypatch):
    monkeypatch.setattr(gpu_flags, "jax_uses_a_gpu", lambda environ: True)
    monkeypatch.setattr(gpu_flags, "_backend_started", lambda: False)
    for off in ({}, {gpu_flags.ENV: ""}, {gpu_flags.ENV: "off"}):
        assert gpu_flags.apply(off) == [] and "XLA_FLAGS" not in off  # the default: nothing
    environ = {**ON, "XLA_FLAGS": "--xla_gpu_enable_while_loop_double_buffering=false"}
    if not gpu_flags.jaxlib_checked():
        pytest.skip("this jaxlib is not one the flags were checked in: apply() adds none (warns)")
    added = gpu_flags.apply(environ)
    assert "xla_gpu_enable_while_loop_double_buffering" not in {f.name for f in added}
    assert environ["XLA_FLAGS"].split()[0] == "--xla_gpu_enable_while_loop_double_buffering=false"
    assert gpu_flags.named_flags(environ["XLA_FLAGS"]) == {f.name for f in gpu_flags.RECOMMENDED}


def test_an_unchecked_jaxlib_or_a_started_backend_gets_a_warning_and_no_flags(monkeypatch):
    monkeypatch.setattr(gpu_flags, "jax_uses_a_gpu", lambda environ: True)
    monkeypatch.setattr(gpu_flags, "jaxlib_checked", lambda: False)
    environ = dict(ON)
    with pytest.warns(UserWarning, match="checked with jaxlib"):
        assert gpu_flags.apply(environ) == []
    monkeypatch.setattr(gpu_flags, "jaxlib_checked", lambda: True)
    monkeypatch.setattr(gpu_flags, "_backend_started", lambda: True)
    with pytest.warns(UserWarning, match="already started"):
        assert gpu_flags.apply(environ) == []
    assert "XLA_FLAGS" not in environ


def test_jaxlib_versions_and_a_wrong_choice():
    assert gpu_flags.jaxlib_checked("0.10.2") and gpu_flags.jaxlib_checked("0.12.0.1")
    assert not gpu_flags.jaxlib_checked("0.9.0") and not gpu_flags.jaxlib_checked("0.13.0")
    with pytest.raises(UserError, match="TIEFLAX_GPU_XLA_FLAGS='fast' is not a choice"):
        gpu_flags.choice({gpu_flags.ENV: "fast"})


def test_every_flag_says_why_and_where_from():
    for f in gpu_flags.RECOMMENDED:
        assert f.name.startswith("xla_gpu_") and f.value and f.why and "JAX-Toolbox" in f.source
    assert len({f.name for f in gpu_flags.RECOMMENDED}) == len(gpu_flags.RECOMMENDED)
