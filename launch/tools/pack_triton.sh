#!/usr/bin/env bash
# Pack a triton wheel from the package registry small enough to carry to the GPU machine, whose image has
# triton 3.6 and no network (docs/performance.md, "Warp-specialised dK/dV").
#
# Usage, here in the repo's root:
#   bash launch/tools/pack_triton.sh 3.9.0        # writes .triton/triton-3.9.0.tar.xz (about 50 MB; .triton/ is ignored)
#
# and on the GPU machine (the device tool's run, with carry [".triton"]):
#
#   mkdir -p /tmp/triton && tar -xJf .triton/triton-3.9.0.tar.xz -C /tmp/triton
#   export PYTHONPATH=/tmp/triton:. TRITON_BACKENDS_IN_TREE=1   # before the image's triton; no AMD backend
#
# The cp312 wheel (the image's Python) keeps the NVIDIA backend, its libdevice and the ptxas triton uses for
# sm_90 and newer; the AMD backend, profiler libraries and test helpers go, and libtriton.so loses its debug
# symbols (500 -> 184 MB).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  "" | -*) echo "usage: bash launch/tools/pack_triton.sh VERSION" >&2; exit 2 ;;
esac
version=$1
out=.triton
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work" "triton==$version"
unzip -q "$work"/triton-"$version"-*.whl -d "$work/pkg"
cd "$work/pkg"
rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti triton/backends/nvidia/lib/cupti-blackwell \
    triton/backends/nvidia/bin/ptxas triton/backends/nvidia/bin/nvdisasm triton/backends/nvidia/bin/cuobjdump \
    triton/instrumentation triton/plugins triton/FileCheck triton/include triton/_C/libproton.so \
    triton-"$version".dist-info/RECORD
sed -i '/^amd = /d' triton-"$version".dist-info/entry_points.txt
strip triton/_C/libtriton.so
cd - >/dev/null
mkdir -p "$out"
tar -C "$work/pkg" -cf - . | xz -9 -T0 > "$out/triton-$version.tar.xz"
ls -l "$out/triton-$version.tar.xz"
