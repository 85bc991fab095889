#!/usr/bin/env bash
# Writes tests/constraints/pyVERSION.txt: the versions a new venv resolves today for the test command's
# extras, without the current constraints. Run the suite on that venv before committing the file.
#
# Usage: tools/refresh_constraints.sh 3.11|3.12
set -euo pipefail
case "${1:-}" in
  3.11) extras='.[test,hf,ray]' ;;
  3.12) extras='.[test]' ;;
  -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
  *) echo "refresh_constraints.sh: give 3.11 or 3.12 (see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
venv=".venv-refresh-$1"
out="tests/constraints/py$1.txt"
# The README's test command, without the constraints (uv: the one that command installs in .venv).
if [[ $1 == 3.11 ]]; then
  python3 -m venv "$venv" && "$venv/bin/pip" install -q uv torch==2.13.0
  "$venv/bin/uv" pip install -q -p "$venv" -e "$extras"
else
  PYENV_VERSION=3.12.1 uv venv -q --allow-existing -p 3.12 "$venv" && uv pip install -q -p "$venv" -e "$extras"
fi
header=$(sed -n '/^#/p' "$out" | sed "s/([0-9-]*)/($(date +%F))/")
{ echo "$header"; uv pip freeze -p "$venv/bin/python" | grep -v -E '^(-e |tieflax|torch==|uv==)'; } > "$out"
echo "wrote $out from $venv: run the suite there (. $venv/bin/activate && python -m pytest -q) before committing it"
