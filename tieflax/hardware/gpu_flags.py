"""The GPU XLA flags tieflax can set for a run on NVIDIA GPUs: NVIDIA's recommendations for LLM training.

``TIEFLAX_GPU_XLA_FLAGS`` chooses:

- ``off`` (the default, also when unset): tieflax adds no XLA flag;
- ``recommended``: on a machine where JAX will use an NVIDIA GPU, the flags of :data:`RECOMMENDED` are
  added to ``XLA_FLAGS`` before JAX starts its GPU backend (the console does it at start; a script calls
  ``tieflax.hardware.process.prepare_process()``).

**Off by default until a GPU measures them**: no GPU has timed tieflax's step with these flags yet
(``benchmarks/gpu_step.py`` runs the variant ``tieflax-tied-xla-flags`` beside the defaults for that). Most
of them act on collectives (several GPUs); on one GPU only the loop double buffering and the scheduler
can change the step.

A flag the user already named in ``XLA_FLAGS`` is kept as the user set it, whatever its value. Nothing is
added on a CPU or TPU run: ``JAX_PLATFORMS`` without ``cuda``/``gpu``, ``CUDA_VISIBLE_DEVICES=-1`` or no
NVIDIA device node (JAX's own probe, read without importing JAX: :mod:`tieflax.hardware.platforms`). XLA stops the
process at start ("Unknown flag in XLA_FLAGS") for a flag its version does not know, so the set is added
only for the jaxlib versions it was checked against (:data:`CHECKED_JAXLIB`); with another jaxlib one
warning says so and nothing is added.

:func:`flags_text` gives the set as one ``XLA_FLAGS`` string, e.g. to compile with it for a GPU target from a
CPU: ``XLA_FLAGS="$(python -c 'from tieflax.hardware.gpu_flags import flags_text; print(flags_text())')"
tieflax plan --topology h100:1 ...``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

from tieflax.errors import UserError

ENV = "TIEFLAX_GPU_XLA_FLAGS"
CHOICES = ("off", "recommended")
# jaxlib minor versions every flag below was checked in: known to XLA (no "Unknown flag") and accepted by
# a deviceless H100 compile (jaxlib 0.10.2 with the CUDA 12 plugin; jaxlib 0.12.0.1's CPU client, which
# parses the same flag list). 0.11 lies between them: a flag known to both is known to it.
CHECKED_JAXLIB = ((0, 10), (0, 11), (0, 12))
NVIDIA_JAX_TOOLBOX = "NVIDIA JAX-Toolbox, docs/GPU_performance.md"
MAXTEXT_ON_GPU = "NVIDIA JAX-Toolbox, docs/frameworks/maxtext/README.md (its recommended XLA_FLAGS)"


@dataclasses.dataclass(frozen=True)
class XlaFlag:
    """One XLA flag: ``--name=value``, why tieflax sets it and who recommends it."""

    name: str
    value: str
    why: str
    source: str

    @property
    def text(self) -> str:
        return f"--{self.name}={self.value}"


GIB = 1 << 30
RECOMMENDED = (
    # Default false in jaxlib 0.10.2 and 0.12. Schedules by estimated latency: starts asynchronous
    # collectives and copies early so compute hides them (the one flag NVIDIA's JAX image sets itself).
    XlaFlag("xla_gpu_enable_latency_hiding_scheduler", "true",
            "overlap collectives and async copies with compute", NVIDIA_JAX_TOOLBOX),
    # Default false in both. Unrolls a while loop (the scanned layers) by two so that iteration i+1's
    # weight all-gather and the scheduler's work can overlap iteration i; a single GPU gains only what the
    # scheduler finds across the two copies of the body.
    XlaFlag("xla_gpu_enable_while_loop_double_buffering", "true",
            "overlap one scanned layer's collectives with the previous layer's compute", NVIDIA_JAX_TOOLBOX),
    # Default false in 0.10.2, true in 0.12 (kept: the 0.10 stack runs on GPUs too). Moves a scanned layer's
    # all-gather (FSDP weights) into the previous iteration and its all-reduce into the next.
    XlaFlag("xla_gpu_enable_pipelined_all_gather", "true",
            "FSDP: gather the next layer's weights during this layer", NVIDIA_JAX_TOOLBOX),
    XlaFlag("xla_gpu_enable_pipelined_all_reduce", "true",
            "data parallel: reduce a layer's gradients during the next layer's backward", NVIDIA_JAX_TOOLBOX),
    # Larger combined collectives reach more of the link's bandwidth; MaxText's values on H100 nodes
    # (at least one layer's weights or gradients: Llama-3-8B's layer is 218M parameters, 0.4 GB in bf16).
    XlaFlag("xla_gpu_all_gather_combine_threshold_bytes", str(GIB),
            "FSDP: one all-gather per layer, not many small ones", MAXTEXT_ON_GPU),
    XlaFlag("xla_gpu_all_reduce_combine_threshold_bytes", str(GIB),
            "data parallel: fewer, larger gradient all-reduces", MAXTEXT_ON_GPU),
    XlaFlag("xla_gpu_reduce_scatter_combine_threshold_bytes", str(GIB // 8),
            "FSDP: fewer, larger gradient reduce-scatters", MAXTEXT_ON_GPU),
)
# Left out, and why (docs/gpu.md lists them too):
# - xla_gpu_enable_pipelined_reduce_scatter=true, xla_gpu_enable_highest_priority_async_stream=true,
#   xla_gpu_enable_{all_gather,reduce_scatter}_combine_by_dim=false: already the default in 0.10.2 and 0.12.
# - xla_gpu_enable_command_buffer (CUDA graphs): on by default; NVIDIA's advice differs (MaxText's list turns
#   it off with an empty value, the Blackwell notes keep FUSION,CUSTOM_CALL): a GPU must decide.
# - xla_disable_hlo_passes=rematerialization (MaxText's list): decides whether a step fits, not its speed
#   (XLA rematerialises only over the memory limit), and would override a user's own list of passes.
# - xla_gpu_enable_dynamic_slice_fusion (named address_computation_fusion in NVIDIA's doc): default true in
#   0.12, false in 0.10.2, where NVIDIA's MaxText notes advise it off ("sometimes leads to error").
# - Unknown to jaxlib 0.10.2 and 0.12 (XLA would stop at start): xla_gpu_enable_custom_fusions,
#   xla_gpu_enable_address_computation_fusion, xla_gpu_graph_level, xla_gpu_enable_triton_softmax_fusion,
#   xla_gpu_enable_async_collectives, xla_gpu_enable_async_all_gather (and the other async_*),
#   xla_gpu_simplify_all_fp_conversions.


def flags_text(flags=RECOMMENDED) -> str:
    """The flags as one ``XLA_FLAGS`` string."""
    return " ".join(f.text for f in flags)


def named_flags(xla_flags: str) -> set[str]:
    """The flag names an ``XLA_FLAGS`` string sets: ``"--a=1 --b" -> {"a", "b"}``."""
    return {token[2:].split("=", 1)[0] for token in xla_flags.split() if token.startswith("--")}


def merge(xla_flags: str, flags=RECOMMENDED) -> tuple[str, list[XlaFlag]]:
    """``xla_flags`` with each of ``flags`` the string does not name appended; the user's own stay as set.

    Returns the new string and the flags added (in the order given)."""
    mine = named_flags(xla_flags)
    added = [f for f in flags if f.name not in mine]
    return " ".join([xla_flags.strip()] + [f.text for f in added]).strip(), added


def choice(environ=os.environ) -> str:
    """``TIEFLAX_GPU_XLA_FLAGS``: ``off`` (unset or empty) or ``recommended``; anything else is refused."""
    value = environ.get(ENV, "").strip().lower() or "off"
    if value not in CHOICES:
        raise UserError(f"{ENV}={environ[ENV]!r} is not a choice: set it to one of {', '.join(CHOICES)} "
                        f"(or leave it unset: off)")
    return value


def jax_uses_a_gpu(environ=os.environ) -> bool:
    """Whether JAX, started now with ``environ``, would run on an NVIDIA GPU (without importing JAX)."""
    platforms = environ.get("JAX_PLATFORMS")
    if platforms is not None and not {"cuda", "gpu"} & {p.strip() for p in platforms.lower().split(",")}:
        return False
    if environ.get("CUDA_VISIBLE_DEVICES", "").strip() in ("-1",):
        return False
    try:
        from tieflax.hardware.platforms import jax_hardware_probe  # noqa: PLC0415 (only when the flags are asked for)

        return bool(jax_hardware_probe().has_visible_nvidia_gpu())
    except Exception:  # noqa: BLE001 (no jax, or a probe that cannot read /dev: not a GPU run we can see)
        return False


def jaxlib_checked(version: str | None = None) -> bool:
    """Whether the installed jaxlib (or ``version``) is one the flags were checked in."""
    if version is None:
        import importlib.metadata  # noqa: PLC0415

        try:
            version = importlib.metadata.version("jaxlib")
        except importlib.metadata.PackageNotFoundError:
            return False
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return major_minor in CHECKED_JAXLIB


def _backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and bridge.backends_are_initialized())


def apply(environ=os.environ) -> list[XlaFlag]:
    """Adds the chosen flags to ``environ['XLA_FLAGS']`` for a GPU run; returns the flags added.

    Call before JAX's first backend use (``tieflax.hardware.process.prepare_process`` does, which the console
    calls first thing). Nothing happens when the choice is
    ``off`` or not one of :data:`CHOICES`, JAX will not use a GPU, the jaxlib was not checked (a warning),
    or JAX's backends already started (a warning: XLA read its flags then).

    Never raises: it runs as the console starts, where an exception is a traceback before any command, even
    ``--help``, can say one line. A value that is not a choice adds nothing here; the console refuses it at
    a command's start (``tieflax.cli.check_settings``: :func:`choice` in one line)."""
    try:
        chosen = choice(environ)
    except UserError:
        return []
    if chosen == "off" or not jax_uses_a_gpu(environ):
        return []
    if not jaxlib_checked():
        warnings.warn(f"{ENV}=recommended: the flags were checked with jaxlib "
                      f"{', '.join('%d.%d' % v for v in CHECKED_JAXLIB)} only, and XLA stops at start on a flag "
                      f"it does not know: none added (set XLA_FLAGS yourself; {__name__}.flags_text() lists them)", stacklevel=2)
        return []
    merged, added = merge(environ.get("XLA_FLAGS", ""))
    if added and _backend_started():
        warnings.warn(f"{ENV}=recommended: JAX's backends already started and read XLA_FLAGS; set it before "
                      "the first JAX computation (tieflax.hardware.process.prepare_process() first)",
                      stacklevel=2)
        return []
    environ["XLA_FLAGS"] = merged
    return added
