#!/usr/bin/env bash
# Repack the GPU kit that ../shared/tools/gpukit.sh built (.gpukit/) so that it and the project's tracked
# files fit the 64 MiB a device run carries: the shipped EAGLE-3 head (20 MB) left the plain kit (55 MB)
# over it. The wheels are unpacked into one xz tarball without their tests (numpy's alone is 18 MB as a
# wheel), tritonserver is recompressed at xz -9e, and the tokenizer is packed; activate.sh unpacks them
# into /tmp/site as the plain kit's pip install did (a wheel's install is its unzipped tree).
#   make gpukit      # runs this after the shared script
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
KIT=$ROOT/.gpukit
[ -f "$KIT/activate.sh" ] || { echo "no $KIT: run ../shared/tools/gpukit.sh first" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if compgen -G "$KIT/*.whl" > /dev/null; then
  mkdir -p "$WORK/site"
  for wheel in "$KIT"/*.whl; do unzip -q -o "$wheel" -d "$WORK/site"; done
  find "$WORK/site" -type d -name tests -prune -exec rm -rf {} +
  tar -C "$WORK/site" -cf - . | xz -9e -T0 > "$KIT/site.tar.xz"
  rm -f "$KIT"/*.whl
fi
if [ ! -f "$KIT/.pytriton-9e" ]; then
  mkdir -p "$WORK/pt" && tar -C "$WORK/pt" -xJf "$KIT/pytriton.tar.xz"
  tar -C "$WORK/pt" -cf - pytriton nvidia_pytriton.libs | xz -9e -T0 > "$KIT/pytriton.tar.xz"
  touch "$KIT/.pytriton-9e"
fi
if [ -d "$KIT/tokenizer" ]; then
  tar -C "$KIT" -cJf "$KIT/tokenizer.tar.xz" tokenizer && rm -rf "$KIT/tokenizer"
fi

cat > "$KIT/activate.sh" <<'EOF'
# Source on the GPU machine from the project root: sets up /tmp/site and the environment.
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$KIT")
if [ ! -f /tmp/site/.ready ]; then
  mkdir -p /tmp/site
  tar -C /tmp/site -xJf "$KIT/site.tar.xz"
  tar -C /tmp/site -xJf "$KIT/pytriton.tar.xz"
  tar -C /tmp/site -xJf "$KIT/transformers.tar.xz"
  # The image's scipy needs numpy 2; transformers imports it when present: shadow it.
  mkdir -p /tmp/site/scipy/optimize && touch /tmp/site/scipy/__init__.py
  printf 'def linear_sum_assignment(*a, **k):\n    raise NotImplementedError\n' > /tmp/site/scipy/optimize/__init__.py
  touch /tmp/site/.ready
fi
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
echo "import sys; sys.path[0:0] = ['$ROOT/src', '$ROOT', '/tmp/site']" > "$SP/zz_project.pth"
export PYTHONPATH=$ROOT/src:$ROOT:/tmp/site
export PYTHONUNBUFFERED=1
if [ -f "$KIT/tokenizer.tar.xz" ]; then
  export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache}
  mkdir -p "$SPECDEC_CACHE/tokenizers"
  tar -C "$SPECDEC_CACHE/tokenizers" -xJf "$KIT/tokenizer.tar.xz"
  rm -rf "$SPECDEC_CACHE/tokenizers/smollm2" && mv "$SPECDEC_CACHE/tokenizers/tokenizer" "$SPECDEC_CACHE/tokenizers/smollm2"
fi
python3 -c "import torch, transformers, numpy; print('gpukit:', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
EOF
du -sb "$KIT"
