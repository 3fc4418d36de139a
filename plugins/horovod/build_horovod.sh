#!/usr/bin/env bash
# Reproducible, cached CPU build of Horovod 0.28.1 (PyTorch + Gloo, no MPI/TF/MXNet).
#
# Usage:  PYTHON=/path/to/venv/bin/python plugins/horovod/build_horovod.sh
#
# Env:
#   PYTHON                 interpreter of the target venv (default: python3). torch must
#                          already be installed there (this script never installs torch).
#   HOOKLOOP_WHEEL_CACHE   wheel cache dir (default: $HOME/.cache/hookloop/wheels)
#   HOOKLOOP_BUILD_JOBS    parallel compile jobs (default: 2)
#   HOOKLOOP_BUILD_VERBOSE=1  stream the compiler output instead of logging it to a file
#   HOOKLOOP_FORCE_REBUILD=1  ignore an existing install and cached wheel
#
# See BUILD.md beside this file for why the sdist needs patching (C++14 -> C++17).
set -euo pipefail

HVD_VERSION=0.28.1
PYTHON=${PYTHON:-python3}
CACHE_ROOT=${HOOKLOOP_WHEEL_CACHE:-$HOME/.cache/hookloop/wheels}
JOBS=${HOOKLOOP_BUILD_JOBS:-2}
VERBOSE=${HOOKLOOP_BUILD_VERBOSE:-0}
FORCE=${HOOKLOOP_FORCE_REBUILD:-0}

T0=$(date +%s)
log()  { printf '[build_horovod +%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die()  { printf '[build_horovod] ERROR: %s\n' "$*" >&2; exit 1; }
vpip() { "$PYTHON" -m pip --disable-pip-version-check "$@"; }

# Verifies horovod.torch imports, is the expected version and has Gloo compiled in.
verify_py='
import horovod, horovod.torch as hvd
assert horovod.__version__ == "'"$HVD_VERSION"'", horovod.__version__
assert hvd.gloo_built(), "horovod.torch was built without Gloo"
print("horovod %s: gloo_built=%s mpi_built=%s nccl_built=%s" % (
    horovod.__version__, hvd.gloo_built(), hvd.mpi_built(), bool(hvd.nccl_built())))
'

# ---------------------------------------------------------------- 0. target interpreter
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON not found"
PYTHON=$(command -v "$PYTHON")

# ---------------------------------------------------------------- 1. already installed?
if [[ "$FORCE" != 1 ]] && out=$("$PYTHON" -c "$verify_py" 2>/dev/null); then
  log "already installed and working ($PYTHON): $out"
  exit 0
fi

TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) \
  || die "torch is not importable by $PYTHON; install torch first (e.g. pip install torch==2.13.0). This script never installs torch."
PY_TAG=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
log "python: $PYTHON ($PY_TAG), torch $TORCH_VERSION"

# The extension links against libtorch, so a wheel is only valid for the exact torch
# version (and Python ABI) it was compiled against: key the cache on both.
CACHE_DIR="$CACHE_ROOT/torch-${TORCH_VERSION}-${PY_TAG}"
mkdir -p "$CACHE_DIR" "$CACHE_ROOT/sdist"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/hookloop-horovod.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT

find_cached() {
  local w
  for w in "$CACHE_DIR"/horovod-"$HVD_VERSION"-"$PY_TAG"-*.whl; do
    [[ -f "$w" ]] && { printf '%s\n' "$w"; return 0; }
  done
  return 1
}

# Serialise concurrent builds against the same cache.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE_DIR/.lock"
  flock 9 || die "could not lock $CACHE_DIR/.lock"
fi

WHEEL=""
if [[ "$FORCE" != 1 ]] && WHEEL=$(find_cached); then
  log "using cached wheel: $WHEEL"
else
  # ------------------------------------------------------------ 2. build prerequisites
  command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
    || die "no C++ compiler (apt-get install g++)"
  command -v make >/dev/null 2>&1 || die "make not found (apt-get install make)"

  # setup.py imports setuptools + packaging; pip's legacy bdist_wheel path needs wheel.
  missing=()
  "$PYTHON" -c 'import setuptools' 2>/dev/null || missing+=(setuptools)
  "$PYTHON" -c 'import wheel'      2>/dev/null || missing+=(wheel)
  "$PYTHON" -c 'import packaging'  2>/dev/null || missing+=(packaging)
  # setup.py wants cmake >= 3.13 on PATH (otherwise it pip-installs cmake~=3.13 itself).
  # cmake 4.x drops support for the old cmake_minimum_required() of bundled third_party.
  cmake_ok=0
  if command -v cmake >/dev/null 2>&1; then
    cv=$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
    if "$PYTHON" - "$cv" <<'EOF' 2>/dev/null
import sys
v = tuple(int(x) for x in sys.argv[1].split(".")[:2])
sys.exit(0 if (3, 13) <= v < (4, 0) else 1)
EOF
    then cmake_ok=1; fi
  fi
  [[ $cmake_ok == 1 ]] || missing+=("cmake>=3.13,<4")
  if ((${#missing[@]})); then
    log "installing build deps into the venv: ${missing[*]}"
    vpip install -q "${missing[@]}"
  fi
  VENV_BIN=$(dirname "$PYTHON")
  export PATH="$VENV_BIN:$PATH"   # a venv-installed cmake wins if we had to install one
  log "cmake: $(command -v cmake) ($(cmake --version | head -n1))"

  # ------------------------------------------------------------ 3. sdist (cached too)
  SDIST="$CACHE_ROOT/sdist/horovod-$HVD_VERSION.tar.gz"
  if [[ ! -f "$SDIST" ]]; then
    log "downloading horovod==$HVD_VERSION sdist"
    # pip download prepares metadata in an isolated env; that needs setuptools only.
    vpip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$WORK/dl"
    shopt -s nullglob; dl=("$WORK"/dl/horovod-"$HVD_VERSION".tar.gz); shopt -u nullglob
    ((${#dl[@]} == 1)) || die "sdist download did not produce horovod-$HVD_VERSION.tar.gz"
    cp "${dl[0]}" "$SDIST.tmp.$$" && mv -f "$SDIST.tmp.$$" "$SDIST"
  else
    log "using cached sdist: $SDIST"
  fi
  tar -xzf "$SDIST" -C "$WORK"
  SRC="$WORK/horovod-$HVD_VERSION"
  [[ -f "$SRC/setup.py" ]] || die "unexpected sdist layout in $SDIST"

  # ------------------------------------------------------------ 4. patch C++14 -> C++17
  # torch >= 2.1 headers require C++17; horovod 0.28.1 forces C++14 in two places.
  for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    [[ -f "$f" ]] || die "missing $f"
    sed -E -i 's/(set[[:space:]]*\([[:space:]]*CMAKE_CXX_STANDARD[[:space:]]+)1[14]([[:space:]]*\))/\117\2/' "$f"
    if grep -Eq 'set[[:space:]]*\([[:space:]]*CMAKE_CXX_STANDARD[[:space:]]+1[14][[:space:]]*\)' "$f"; then
      die "C++17 patch did not take in $f"
    fi
    grep -Eq 'set[[:space:]]*\([[:space:]]*CMAKE_CXX_STANDARD[[:space:]]+17[[:space:]]*\)' "$f" \
      || die "C++17 patch: no CMAKE_CXX_STANDARD 17 in $f (sdist changed?)"
  done
  log "patched CMAKE_CXX_STANDARD to 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt"

  # ------------------------------------------------------------ 5. build the wheel
  unset HOROVOD_WITHOUT_PYTORCH HOROVOD_WITHOUT_GLOO HOROVOD_WITH_MPI \
        HOROVOD_WITH_TENSORFLOW HOROVOD_WITH_MXNET HOROVOD_GPU_OPERATIONS \
        HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLGATHER || true
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
         HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
         HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="-j$JOBS"
  BUILD_LOG="$WORK/build.log"
  log "building wheel (MAKEFLAGS=$MAKEFLAGS; ~4 min on 2 cores) ..."
  TB=$(date +%s)
  build=(vpip wheel -v --no-build-isolation --no-deps --no-cache-dir -w "$WORK/dist" "$SRC")
  if [[ "$VERBOSE" == 1 ]]; then
    "${build[@]}" 2>&1 | tee "$BUILD_LOG"
  elif ! "${build[@]}" >"$BUILD_LOG" 2>&1; then
    keep="${TMPDIR:-/tmp}/hookloop-horovod-build-$(date +%Y%m%d%H%M%S).log"
    cp "$BUILD_LOG" "$keep"
    tail -n 60 "$BUILD_LOG" >&2
    die "wheel build failed; full log: $keep"
  fi
  log "wheel built in $(( $(date +%s) - TB ))s"
  shopt -s nullglob; built=("$WORK"/dist/horovod-"$HVD_VERSION"-*.whl); shopt -u nullglob
  ((${#built[@]} == 1)) || die "expected one horovod wheel in $WORK/dist"

  # ------------------------------------------------------------ 6. store atomically
  WHEEL="$CACHE_DIR/$(basename "${built[0]}")"
  cp "${built[0]}" "$WHEEL.tmp.$$"
  mv -f "$WHEEL.tmp.$$" "$WHEEL"
  log "cached wheel: $WHEEL"
fi

# ---------------------------------------------------------------- 7. install
# Runtime deps = unconditional Requires-Dist of the wheel (cloudpickle, psutil, pyyaml,
# packaging); framework extras are skipped and torch is never requested.
"$PYTHON" -c 'import packaging' 2>/dev/null || vpip install -q packaging
deps_txt=$("$PYTHON" - "$WHEEL" <<'EOF'
import sys, zipfile, email
from packaging.requirements import Requirement
zf = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
msg = email.message_from_bytes(zf.read(meta))
for line in msg.get_all("Requires-Dist") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name.lower() in {"torch", "tensorflow", "mxnet"}:
        continue
    print(str(r).split(";")[0])
EOF
) || die "could not read runtime deps from $WHEEL"
DEPS=()
[[ -n "$deps_txt" ]] && mapfile -t DEPS <<<"$deps_txt"
if ((${#DEPS[@]})); then
  log "installing runtime deps: ${DEPS[*]}"
  vpip install -q "${DEPS[@]}"
fi
log "installing $(basename "$WHEEL") (--no-deps)"
vpip install -q --no-deps --force-reinstall "$WHEEL"

out=$("$PYTHON" -c "$verify_py") || die "installed horovod failed verification"
log "OK: $out"
log "horovodrun: $(dirname "$PYTHON")/horovodrun (put $(dirname "$PYTHON") first on PATH when launching)"
