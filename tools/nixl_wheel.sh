#!/usr/bin/env bash
# Puts a nixl-cu13 wheel for the GPU machine (Python 3.12, x86-64) into .whl/, small enough to be
# carried to it (the device tool carries 64 MiB a call, tree included): the wheel is 58.8 MB, of
# which its EP extension (three builds for torch 2.12-2.14, which warmlink does not load) and UCX's
# perftest are dropped, leaving ~29 MB. Its RECORD is rewritten without them, or pip refuses it.
# Usage: tools/nixl_wheel.sh [VERSION]   (default 1.5.1); then carry .whl and run the `nixl` stage
# of tools/device_run.sh first. Keep .whl/ out of git (.git/info/exclude).
set -euo pipefail
version=${1:-1.5.1}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work" "nixl-cu13==$version"
wheel=$(ls "$work"/nixl_cu13-*.whl)
mkdir "$work/x"
(cd "$work/x" && python3 -m zipfile -e "$wheel" . && rm -rf nixl_ep_cu13 && find . -name '*perftest*' -delete)
python3 - "$work/x" <<'EOF'
import csv, glob, os, sys
root = sys.argv[1]
(record,) = glob.glob(os.path.join(root, "*.dist-info", "RECORD"))
rows = [r for r in csv.reader(open(record)) if r and os.path.exists(os.path.join(root, r[0]))]
with open(record, "w", newline="") as f:
    csv.writer(f).writerows(rows)
EOF
mkdir -p .whl
rm -f .whl/nixl_cu13-*.whl
out="$PWD/.whl/$(basename "$wheel")"
(cd "$work/x" && python3 -m zipfile -c "$out" $(ls -A))
ls -la "$out"
