#!/usr/bin/env bash
# The train step on one GPU, measured and profiled in one call (issue: tieflax vs HF + Liger on a 1B model).
#
# Usage:
#   launch/gpu_measure.sh wheels   # where pip reaches PyPI: the wheels a bare GPU image lacks, into .whl/
#   launch/gpu_measure.sh          # on the GPU machine, from the repository root: everything below
#   launch/gpu_measure.sh --help   # this text
# Settings (environment): OUT (the output folder), PROFILE_DIR (the profiles' scratch folder, emptied at the
# start; default /tmp/gpu_measure_profile), PYTHON (default python3), SMOKE=1 (a tiny model on a CPU).
#
# On the GPU machine: installs .whl/*.whl (if there) into /tmp/site, then runs, each under a time limit so
# the whole stays under 10 minutes,
#   1. benchmarks/gpu.py (the loss alone: naive JAX, tieflax xla, auto = the Mosaic GPU kernels on Hopper+,
#      mosaic_gpu, Liger, cut-cross-entropy), if this checkout has it;
#   2. benchmarks/gpu_step.py --profile: tieflax tied, tied + the recommended GPU XLA flags, untied, HF,
#      HF + Liger (Llama-3.2-1B, 8 x 2048);
#   3. tools/profile_table.py on the tieflax and HF (+ Liger) profiles, with the step's HLO.
# Everything lands flat in $OUT (default ./gpu_measure_out): log.txt (all output), gpu_step.json,
# profile_table.md, profile_table.json, the profiles gzipped (tieflax-tied.xplane.pb.gz,
# tieflax-tied.hlo.txt.gz, hf-liger.trace.json.gz; left out if over 16 MiB) and nvidia-smi.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(grain ml-collections array-record portpicker liger-kernel cut-cross-entropy)

# The arguments, before anything runs (the measurement starts by emptying PROFILE_DIR).
usage() { sed -n "2,$(grep -n '^set -uo pipefail' "$0" | cut -d: -f1)p" "$0" | sed '$d'; }
die() { echo "gpu_measure.sh: $*" >&2; exit 2; }
if [[ $# -gt 0 ]]; then
  case "$1" in
    --help|-h) usage; exit 0 ;;
    wheels) [[ $# -eq 1 ]] || die "unknown argument '$2' after wheels (see --help)" ;;
    *) die "unknown argument '$1': give wheels, nothing, or --help" ;;
  esac
fi

if [[ "${1:-}" == "wheels" ]]; then
  # Python 3.12 manylinux wheels, no dependencies: the GPU image has the rest (absl, etils, torch, triton).
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
fi

OUT=${OUT:-$PWD/gpu_measure_out}
PROFILE=${PROFILE_DIR:-/tmp/gpu_measure_profile}
mkdir -p "$OUT" && rm -rf "$PROFILE"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_measure: installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "gpu_measure: no .whl/ here; assuming ${WHEELS[*]} are installed"
  export PYTHONPATH=$PWD
fi
date -u; nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; head -12 "$OUT/nvidia-smi.txt"
"$PY" -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__, '| transformers', transformers.__version__)"

if [[ -f benchmarks/gpu.py ]]; then
  # gpu.py starts no variant after 300 s by itself; the limits below (180 + 300 + 60 + 40 s, and install)
  # keep the whole call under 10 minutes.
  echo "== benchmarks/gpu.py (limit 180 s)"
  timeout -k 10 180 "$PY" benchmarks/gpu.py || echo "gpu_measure: benchmarks/gpu.py ended with status $?"
fi

# --budget-s: no variant starts late and a running one stops in time, so the table of the rest still prints.
echo "== benchmarks/gpu_step.py --profile (limit 300 s)"
timeout -k 10 300 "$PY" benchmarks/gpu_step.py --profile "$PROFILE" --budget-s 280 | tee "$PROFILE.stdout" \
  || echo "gpu_measure: benchmarks/gpu_step.py ended with status $?"
grep '^{"benchmark"' "$PROFILE.stdout" > "$OUT/gpu_step.json" || true

echo "== tools/profile_table.py"
profiles=()
[[ -d "$PROFILE/tieflax-tied" ]] && profiles+=("$PROFILE/tieflax-tied")
[[ -f "$PROFILE/hf-liger.trace.json" ]] && profiles+=("$PROFILE/hf-liger.trace.json")
hlo=(); [[ -f "$PROFILE/tieflax-tied.hlo.txt" ]] && hlo=(--hlo "$PROFILE/tieflax-tied.hlo.txt")
if (( ${#profiles[@]} )); then
  timeout -k 10 60 "$PY" tools/profile_table.py "${profiles[@]}" "${hlo[@]}" | tee "$OUT/profile_table.md"
  timeout -k 10 40 "$PY" tools/profile_table.py "${profiles[@]}" "${hlo[@]}" --json > "$OUT/profile_table.json"
fi

# The raw profiles, gzipped and flat (what comes back is at most 16 MiB a file).
for f in "$PROFILE"/tieflax-tied/plugins/profile/*/*.xplane.pb "$PROFILE/tieflax-tied.hlo.txt" \
         "$PROFILE/hf-liger.trace.json"; do
  [[ -f "$f" ]] || continue
  name=$(basename "$f"); [[ "$name" == *.xplane.pb ]] && name=tieflax-tied.xplane.pb
  gzip -c "$f" > "$OUT/$name.gz"
  if (( $(stat -c %s "$OUT/$name.gz") > 16 * 1024 * 1024 )); then
    echo "gpu_measure: $name.gz is over 16 MiB, left out"; rm "$OUT/$name.gz"
  fi
done
date -u; ls -la "$OUT"
