"""Compile targets for ``tieflax plan``: abstract TPU pods, GPU servers without a GPU, or the host's CPUs.

A target is a list of devices JAX can compile for plus the memory one device has. Nothing runs on
them: TPU topologies come from libtpu (``jax.experimental.topologies``, the ``tpu`` extra), GPUs from
an XLA ``GpuTargetConfig`` text proto compiled through the CUDA plugin (the ``gpu`` extra) with no GPU
attached.

Topology names::

    v4:2x2x1 ... v4:4x4x4    v5e:2x2 ... v5e:8x16    v5p:2x2x1 ... v5p:8x8x8    v6e:2x2 ... v6e:16x16
    h100:8   h100_pcie:8   h200:8   a100:8 (80 GB)   a100_40gb:8   (1-8 GPUs per host; more as whole
    hosts of 8)
    cpu      (the devices of this process)

Memory per device. ``usable`` is what the TPU compiler accepts, read from its own out-of-memory error
(``RESOURCE_EXHAUSTED: ... exceeds available HBM (15.75G)``, libtpu 0.0.42) when compiling a program
that needs 168 GiB of temporaries for one device of ``v4:2x2x1``, ``v5e:2x2``, ``v5p:2x2x1`` and
``v6e:2x2``; ``nominal`` is the chip's HBM as Google documents it. libtpu exposes a v4 chip as two
TensorCore devices of 16 GiB each (``v4:2x2x1`` has 8 devices), so a v4 "device" is half a chip. For
GPUs both are the target config's ``device_memory_size``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import tempfile
from typing import Any

from tieflax.errors import UserError

GIB = 1 << 30

# generation -> (nominal HBM per device, usable HBM per device as the compiler reports it)
TPU_MEMORY: dict[str, tuple[float, float]] = {
    "v4": (16.0, 15.25),     # 32 GiB per chip, two TensorCore devices
    "v5e": (16.0, 15.75),
    "v5p": (95.0, 95.74),
    "v6e": (32.0, 31.25),
}


@dataclasses.dataclass(frozen=True)
class Peak:
    """What one device can do at best: dense bf16 FLOP/s and HBM bytes/s (vendors' published figures)."""
    flops: float
    hbm_bytes_per_second: float


# chip -> peak of one chip: dense bf16 (no sparsity) and HBM bandwidth, from Google's Cloud TPU system
# architecture pages and NVIDIA's data sheets. NVIDIA states its Tensor Core figures "with sparsity": the
# dense rate is half of it. Hopper parts:
#   h100 (SXM)  https://www.nvidia.com/en-us/data-center/h100/  1,979 TF/s sparse bf16, 3.35 TB/s, 80 GB
#   h100_pcie   the same page and NVIDIA's H100 PCIe product brief (PB-11133-001): 1,513 TF/s sparse
#               (114 SMs, 350 W), 2.0 TB/s HBM2e, 80 GB
#   h100_nvl    the same page: 1,671 TF/s sparse, 3.9 TB/s, 94 GB HBM3 (one card of the NVLink pair)
#   h200 (SXM)  https://www.nvidia.com/en-us/data-center/h200/  1,979 TF/s sparse, 4.8 TB/s, 141 GB HBM3e
#   h200_nvl    the same page: 1,671 TF/s sparse, 4.8 TB/s, 141 GB HBM3e
# The SXM and PCIe figures were checked against copies of these tables when they were added; the two NVL
# rates (1,671) were written from NVIDIA's pages as published, not re-read then (third-party copies agree
# on the H100 NVL's 94 GB and 3.9 TB/s).
CHIP_PEAKS: dict[str, Peak] = {
    "v4": Peak(275e12, 1200e9),
    "v5e": Peak(197e12, 819e9),
    "v5p": Peak(459e12, 2765e9),
    "v6e": Peak(918e12, 1640e9),
    "h100": Peak(989e12, 3350e9),
    "h100_pcie": Peak(756.5e12, 2000e9),
    "h100_nvl": Peak(835.5e12, 3900e9),
    "h200": Peak(989e12, 4800e9),
    "h200_nvl": Peak(835.5e12, 4800e9),
    "a100": Peak(312e12, 2039e9),
    "a100_80gb": Peak(312e12, 2039e9),
    "a100_40gb": Peak(312e12, 1555e9),
}
# Compile targets per chip: libtpu's v4 topologies expose each TensorCore as a device (see above).
DEVICES_PER_CHIP = {"v4": 2}
# What JAX devices call themselves (``device_kind``, lower case) -> chip, for training logs' MFU; the first
# whole-word match wins, so the PCIe and NVL parts come before the SXM name they contain, and a GH200
# ('NVIDIA GH200 480GB', another memory) is not taken for an H200. An SXM H100 says 'NVIDIA H100 80GB
# HBM3', the others 'NVIDIA H100 PCIe', 'NVIDIA H100 NVL', 'NVIDIA H200' (XLA's own H200 target config
# says 'NVIDIA H200 141GB HBM3e'). A v4 in its usual megacore mode is one device per chip.
DEVICE_KINDS = (("tpu v5 lite", "v5e"), ("tpu v5e", "v5e"), ("tpu v5p", "v5p"), ("tpu v5", "v5p"),
                ("tpu v6 lite", "v6e"), ("tpu v6e", "v6e"), ("tpu v4", "v4"), ("h100 pcie", "h100_pcie"),
                ("h100 nvl", "h100_nvl"), ("h100", "h100"), ("h200 nvl", "h200_nvl"), ("h200", "h200"),
                ("a100-sxm4-40gb", "a100_40gb"), ("a100", "a100"))


def device_peak(device_kind: str) -> Peak | None:
    """The peak of one device of this ``device_kind`` ('TPU v5 lite', 'NVIDIA H100 80GB HBM3'); None
    where it is not known (a CPU, an unlisted chip)."""
    kind = device_kind.lower()
    for prefix, chip in DEVICE_KINDS:
        if re.search(rf"(?<!\w){re.escape(prefix)}(?!\w)", kind):
            return CHIP_PEAKS[chip]
    return None


GPU_TARGETS = {            # name -> text proto shipped in tieflax/hardware/gpu_targets/
    "h100": "h100.txtpb",
    "h100_pcie": "h100_pcie.txtpb",
    "h200": "h200.txtpb",
    "a100": "a100_80gb.txtpb",
    "a100_80gb": "a100_80gb.txtpb",
    "a100_40gb": "a100_40gb.txtpb",
}
TPU_EXTRA = "pip install 'tieflax[tpu]'"
GPU_EXTRA = "pip install 'tieflax[gpu]'"
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")   # either compiles for a target config


class TargetError(UserError, ValueError):
    """The topology cannot be compiled for here; the message says why and what to install or type."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str                 # as given: 'v5p:4x4x4', 'h100:8', 'cpu'
    platform: str             # 'tpu' | 'cuda' | 'cpu'
    chip: str                 # 'v5p', 'h100', 'cpu'
    device_kind: str          # what the devices call themselves: 'TPU v5', 'NVIDIA H100 80GB HBM3'
    devices: tuple            # jax.Device (abstract for tpu/cuda)
    nominal_bytes: int        # memory per device, as sold
    usable_bytes: int         # memory per device a program may use (fits are judged against this)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def peak(self) -> Peak | None:
        """One device's peak (a v4 compile target is half a chip); None on a CPU."""
        chip = CHIP_PEAKS.get(self.chip)
        if chip is None:
            return None
        share = DEVICES_PER_CHIP.get(self.chip, 1)
        return Peak(chip.flops / share, chip.hbm_bytes_per_second / share)

    def as_dict(self) -> dict[str, Any]:
        return dict(name=self.name, platform=self.platform, chip=self.chip, device_kind=self.device_kind,
                    num_devices=self.num_devices, nominal_bytes=self.nominal_bytes,
                    usable_bytes=self.usable_bytes,
                    libtpu=libtpu_version() if self.platform == "tpu" else None)


# ============================================================================== TPU slice shapes
# The chip grids Google sells, checked here before libtpu sees a name: libtpu aborts the process (SIGABRT,
# a C++ "Check failed", exit 134) on some shapes it does not refuse, e.g. v5e:16x16x2 (chip_bounds().z ==
# 1) or v5e:16x32 (chip_bounds().y <= 16), when compiling for them; it compiles others that no Google
# slice has (v6e:2x2x2, v5e:4x2). Sources, Google's Cloud TPU pages (this table was written from the
# pages as published, without re-reading them in this session: the search tool was not available):
#   v5e  https://cloud.google.com/tpu/docs/v5e  accelerator types v5litepod-1 ... v5litepod-256, topologies
#        1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16 (the name counts chips).
#   v6e  https://cloud.google.com/tpu/docs/v6e  v6e-1 ... v6e-256, the same 2-D shapes (names count chips).
#   v5p  https://cloud.google.com/tpu/docs/v5p  v5p-8 (2x2x1) ... v5p-17920 (16x20x28): 3-D AxBxC, names
#        count TensorCores, 2 per chip (v5p-128 = 64 chips = 4x4x4).
#   v4   https://cloud.google.com/tpu/docs/v4   v4-8 (2x2x1) ... the 4,096-chip pod (16x16x16), 3-D,
#        names count TensorCores (v4-64 = 32 chips = 2x4x4); its "Topologies" section: A <= B <= C, all
#        at most 4 or all multiples of 4, the slices below 64 chips being 2x2x1, 2x2x2, 2x2x4 and 2x4x4.
#   Both 3-D generations: from 64 chips up a slice is whole 4x4x4 cubes, A <= B <= C, each a multiple of
#   4, within the pod (v4 16x16x16 = 4,096 chips, v5p 16x20x28 = 8,960 chips).
# libtpu (0.0.42.1 and 0.0.52) itself refuses 1x1 with an exception (its default host is 2x2x1 chips), so
# a one-chip slice is compiled with a one-chip host (chips_per_host_bounds 1x1x1).
SHAPES_2D = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
SMALL_3D = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
POD_3D = {"v4": (16, 16, 16), "v5p": (16, 20, 28)}
GRID_DIMS = {"v5e": 2, "v6e": 2, "v4": 3, "v5p": 3}
# gcloud accelerator-type prefix -> generation; (the name counts TensorCores, 2 per chip) for v4 and v5p.
GCLOUD_PREFIX = {"v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e", "v5p": "v5p", "v4": "v4"}
CORES_PER_CHIP_IN_NAME = {"v4": 2, "v5p": 2}


def _x(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def allowed_shapes(kind: str) -> str:
    """The rule for a generation's slice shapes, in words (for error messages and ``--help``)."""
    if GRID_DIMS[kind] == 2:
        return f"{kind} slices are 2-D AxB: " + ", ".join(_x(s) for s in SHAPES_2D)
    return (f"{kind} slices are 3-D AxBxC: " + ", ".join(_x(s) for s in SMALL_3D)
            + f", or A <= B <= C, each a multiple of 4, up to {_x(POD_3D[kind])} (4x4x4, 4x4x8, 4x8x8, "
              "8x8x8, ...)")


def check_tpu_shape(name: str) -> tuple[str, tuple[int, ...]]:
    """``'v5p:4x4x4'`` -> ('v5p', (4, 4, 4)) when Google sells that slice; else TargetError in one line.

    Pure Python, before libtpu is loaded: the shapes libtpu aborts on never reach it."""
    kind, _, text = name.partition(":")
    if kind not in GRID_DIMS:
        raise TargetError(f"--topology {name!r}: {kind!r} is not a TPU generation tieflax plans (v4, v5e, "
                          "v5p, v6e)")
    if not re.fullmatch(r"\d+(x\d+)*", text):
        raise TargetError(f"--topology {name!r}: not a chip grid; {allowed_shapes(kind)}")
    shape = tuple(int(n) for n in text.split("x"))
    dims = GRID_DIMS[kind]
    if len(shape) != dims:
        raise TargetError(f"--topology {name!r}: {len(shape)}-D, but {allowed_shapes(kind)}")
    if dims == 2:
        ok = shape in SHAPES_2D
    else:
        pod = POD_3D[kind]
        ok = shape in SMALL_3D or (all(n % 4 == 0 and n > 0 for n in shape) and list(shape) == sorted(shape)
                                   and all(n <= p for n, p in zip(shape, pod)))
    if not ok:
        raise TargetError(f"--topology {name!r}: no {kind} slice has this shape; {allowed_shapes(kind)}")
    return kind, shape


def _cube_shape(kind: str, chips: int) -> tuple[int, int, int] | None:
    """The 3-D slice of ``chips`` chips gcloud gives an accelerator type: the small shapes below 64 chips,
    else the most cube-like A <= B <= C of multiples of 4 within the pod (v5p-128 -> 4x4x4, v5p-256 ->
    4x4x8, v5p-512 -> 4x8x8, v5p-768 -> 4x8x12 ... as in Google's v5p and v4 tables)."""
    for s in SMALL_3D:
        if s[0] * s[1] * s[2] == chips:
            return s
    pod = POD_3D[kind]
    best = None
    for a in range(4, pod[0] + 1, 4):
        for b in range(a, pod[1] + 1, 4):
            c, rest = divmod(chips, a * b)
            if rest or c < b or c > pod[2] or c % 4:
                continue
            if best is None or (c, b) < (best[2], best[1]):
                best = (a, b, c)
    return best


def canonical_topology(topology: str) -> tuple[str, str]:
    """(the topology tieflax compiles for, a line saying how a gcloud name was read or '').

    ``'v5p-128'`` -> ('v5p:4x4x4', 'v5p-128 is v5p:4x4x4, 64 chips (...)'); ``'V5E:2x2 '`` -> ('v5e:2x2',
    ''). TPU grids are checked against Google's slice shapes here (TargetError in one line)."""
    name = topology.strip().lower()
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
    if m:
        prefix, count = m.group(1), int(m.group(2))
        kind = GCLOUD_PREFIX.get(prefix)
        if kind is None:
            raise TargetError(f"--topology {topology!r}: tieflax plans v4, v5e (v5litepod-N), v5p and v6e "
                              "slices")
        per_chip = CORES_PER_CHIP_IN_NAME.get(kind, 1)
        chips, odd = divmod(count, per_chip)
        if GRID_DIMS[kind] == 2:
            shape = next((s for s in SHAPES_2D if s[0] * s[1] == count), None)
            names = ", ".join(f"{prefix}-{a * b}" for a, b in SHAPES_2D)
        else:
            shape = None if odd or not chips else _cube_shape(kind, chips)
            names = f"{prefix}-8, -16, -32, -64, -128, -256, -512, -1024, ... (TensorCores, {per_chip} per chip)"
        if shape is None:
            raise TargetError(f"--topology {topology!r}: not a Cloud TPU accelerator type ({names}); or give "
                              f"the grid: {allowed_shapes(kind)}")
        canonical = f"{kind}:{_x(shape)}"
        cores = (f" (gcloud's {prefix} names count TensorCores, {per_chip} per chip)" if per_chip > 1
                 else "")
        return canonical, f"{name} is {canonical}, {chips} chip{'s' if chips > 1 else ''}{cores}"
    kind, sep, _ = name.partition(":")
    if kind in GRID_DIMS and sep:
        check_tpu_shape(name)
    return name, ""


def is_tpu(topology: str) -> bool:
    """Whether a canonical topology name is a TPU slice (compiled by libtpu)."""
    return topology.partition(":")[0] in TPU_MEMORY and ":" in topology


def resolve(topology: str) -> Target:
    """``'v5p:4x4x4'`` / ``'v5p-128'`` / ``'h100:8'`` / ``'cpu'`` -> Target; raises TargetError with the
    fix. TPU shapes are checked against Google's slices before libtpu is loaded (``check_tpu_shape``)."""
    name, _ = canonical_topology(topology)
    if name == "cpu":
        return _cpu_target()
    kind, sep, shape = name.partition(":")
    if kind in TPU_MEMORY and sep:
        return _tpu_target(name, kind)
    if kind in GPU_TARGETS and sep:
        return _gpu_target(name, kind, shape)
    raise TargetError(
        f"--topology {topology!r}: expected a TPU slice (v4:2x2x1, v5e:2x2, v5p:2x2x1, v6e:2x2, ..., "
        f"e.g. v5p:4x4x4), a GPU count ({', '.join(f'{k}:8' for k in GPU_TARGETS)}) or 'cpu'.")


# libtpu releases before this one report a scanned step's temporaries (memory_analysis) above what their
# own buffer assignment holds, by about the stack of saved layer inputs (0.0.42.1 and 0.0.50.1 seen;
# benchmarks/README.md, "The gap to MaxText"). 0.0.52 reports what it assigns.
LIBTPU_EXACT_TEMPORARIES = (0, 0, 52)


def libtpu_version() -> str | None:
    """The installed libtpu's version; None when absent or replaced through ``TPU_LIBRARY_PATH`` by
    another ``libtpu.so`` (the package itself sets that variable to its own library on import)."""
    spec = importlib.util.find_spec("libtpu")
    if spec is None or not spec.submodule_search_locations:
        return None
    own = os.path.join(spec.submodule_search_locations[0], "libtpu.so")
    chosen = os.environ.get("TPU_LIBRARY_PATH")
    if chosen and os.path.realpath(chosen) != os.path.realpath(own):
        return None
    return importlib.metadata.version("libtpu")


def compiler_note(target: Target) -> str:
    """A line for plans compiled by a libtpu that over-counts scanned steps' temporaries; else ''."""
    version = libtpu_version() if target.platform == "tpu" else None
    release = tuple(int(x) for x in re.findall(r"\d+", version or "")[:3])
    if version is None or release >= LIBTPU_EXACT_TEMPORARIES:
        return ""
    exact = ".".join(map(str, LIBTPU_EXACT_TEMPORARIES))
    return (f"libtpu {version} counts more temporaries for scanned layers than it assigns (about one saved "
            f"input per layer), so these fits are conservative; libtpu {exact} counts what it assigns "
            f"(Python 3.12+: {TPU_EXTRA})")


def _cpu_target() -> Target:
    import jax  # noqa: PLC0415

    devices = tuple(jax.devices("cpu"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_device = ram // len(devices)   # CPU devices of one process share the host's memory
    return Target("cpu", "cpu", "cpu", devices[0].device_kind, devices, per_device, per_device)


def _tpu_target(name: str, kind: str) -> Target:
    _, shape = check_tpu_shape(name)   # before libtpu: it aborts the process on some shapes
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(f"compiling for {name} needs libtpu: {TPU_EXTRA}")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile only: never holds a TPU
    from jax.experimental import topologies  # noqa: PLC0415

    # One chip is one host of one chip (libtpu's default host, 2x2x1 chips, does not divide it).
    options = {"chips_per_host_bounds": (1, 1, 1)} if all(n == 1 for n in shape) else {}
    try:
        with quiet_stderr():
            topo = topologies.get_topology_desc(topology_name=name, platform="tpu", **options)
    except Exception as e:  # noqa: BLE001 (libtpu raises RuntimeError / JaxRuntimeError / ValueError)
        raise TargetError(f"--topology {name!r}: libtpu does not know this slice ({_first_line(e)}); "
                          f"use e.g. {kind}:2x2{'x1' if kind in ('v4', 'v5p') else ''}") from None
    nominal, usable = TPU_MEMORY[kind]
    devices = tuple(topo.devices)
    return Target(name, "tpu", kind, devices[0].device_kind, devices, int(nominal * GIB), int(usable * GIB))


def _gpu_target(name: str, kind: str, shape: str) -> Target:
    if not re.fullmatch(r"\d+", shape) or int(shape) < 1:
        raise TargetError(f"--topology {name!r}: give the number of GPUs, e.g. {kind}:8")
    count = int(shape)
    if count > 8 and count % 8:
        raise TargetError(f"--topology {name!r}: more than 8 GPUs come as whole hosts of 8; use a multiple "
                          "of 8")
    if not any(importlib.util.find_spec(p) for p in CUDA_PLUGINS):
        raise TargetError(f"compiling for {name} needs the CUDA plugin of JAX: {GPU_EXTRA}")
    # No GPU is used, and one must not be required: the plugin compiles for the target config alone.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    from jax.experimental import topologies  # noqa: PLC0415

    proto = gpu_target_config(kind)
    hosts, per_host = (1, count) if count <= 8 else (count // 8, 8)
    topo = topologies.get_topology_desc(platform="cuda", target_config=proto,
                                        topology=f"1x{hosts}x{per_host}")
    memory = int(re.search(r"device_memory_size:\s*(\d+)", proto).group(1))
    devices = tuple(topo.devices)
    return Target(name, "cuda", kind, devices[0].device_kind, devices, memory, memory)


def gpu_target_config(kind: str) -> str:
    """The GpuTargetConfig text proto tieflax ships for ``kind`` (h100, h100_pcie, h200, a100, a100_40gb)."""
    path = os.path.join(os.path.dirname(__file__), "gpu_targets", GPU_TARGETS[kind])
    with open(path) as f:
        return f.read()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


class quiet_stderr:  # noqa: N801 (used as a context manager, like contextlib's)
    """Sends file descriptor 2 to a temporary file while libtpu starts.

    On a machine without a TPU, libtpu's C++ start-up writes lines ("could not determine TPU accelerator
    type", an ``E0000 ... TPU_WORKER_HOSTNAMES`` error, a source trace) that do not concern a compile-only
    run, and Python cannot filter them. ``captured`` holds them afterwards.
    """

    def __enter__(self):
        import sys  # noqa: PLC0415

        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self.captured = ""
        return self

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.captured = self._file.read().decode(errors="replace")
        self._file.close()
        return False
