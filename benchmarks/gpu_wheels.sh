#!/usr/bin/env bash
# Builds the wheel folder benchmarks/gpu_check.sh installs from on a GPU machine that has torch,
# transformers, accelerate and peft but cannot download: vpo itself (--no-deps: none of its heavy
# dependencies), DeepSpeed (built from its source release: pure Python, its CUDA ops compile on first use)
# and DeepSpeed's small dependencies that such a machine lacks. Run where PyPI is reachable:
#
#   bash benchmarks/gpu_wheels.sh                       # -> benchmarks/gpu_wheels/ for CPython 3.12 x86_64
#   bash benchmarks/gpu_wheels.sh --python-version 3.11 --dest /tmp/w
#
# Prints each wheel and its size and fails if the folder exceeds 64 MiB (what travels to the machine).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
dest="$here/gpu_wheels"
pyver="3.12"
platforms=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
python="${PYTHON:-python3}"
limit=$((64 * 1024 * 1024))

# DeepSpeed and what it imports that torch/transformers/accelerate/peft do not bring (numpy, packaging,
# psutil, tqdm, torch come with those). Exact versions: the folder is the same whoever builds it.
DEEPSPEED="deepspeed==0.19.8"
BINARY=(msgpack==1.2.4 ninja==1.13.2 pydantic-core==2.50.5)
PURE=(einops==0.8.2 hjson==3.1.0 py-cpuinfo==9.0.0 pydantic==2.14.4 annotated-types==0.8.0
      typing-inspection==0.4.5 typing-extensions==4.16.0)

die() { echo "error: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dest) dest="${2:?--dest needs a folder}"; shift 2 ;;
    --python-version) pyver="${2:?--python-version needs X.Y}"; shift 2 ;;
    --python) python="${2:?--python needs an interpreter}"; shift 2 ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip"
rm -rf "$dest"
mkdir -p "$dest"
abi="cp${pyver/./}"
plat=()
for p in "${platforms[@]}"; do plat+=(--platform "$p"); done

"$python" -m pip wheel --quiet --no-deps --wheel-dir "$dest" "$repo" || die "could not build the vpo wheel"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$dest" "$DEEPSPEED" || die "could not build $DEEPSPEED"
"$python" -m pip download --quiet --no-deps --only-binary :all: --dest "$dest" --python-version "$pyver" \
  --implementation cp --abi "$abi" --abi abi3 --abi none "${plat[@]}" "${BINARY[@]}" \
  || die "could not download ${BINARY[*]} for $abi"
"$python" -m pip download --quiet --no-deps --only-binary :all: --dest "$dest" "${PURE[@]}" \
  || die "could not download ${PURE[*]}"

for w in "$dest"/*; do
  case "$w" in *.whl) ;; *) die "not a wheel: $w" ;; esac
  case "$(basename "$w")" in *-py3-none-any.whl|*-py2.py3-none-any.whl|*"$abi"*|*-abi3-*|*-py3-none-manylinux*) ;;
    *) die "wheel for another interpreter: $(basename "$w")" ;; esac
done
total=0
for w in "$dest"/*.whl; do
  size=$(stat -c %s "$w")
  total=$((total + size))
  awk -v s="$size" -v n="$(basename "$w")" 'BEGIN { printf "%8.2f MiB  %s\n", s / 1048576, n }'
done
awk -v s="$total" -v d="$dest" 'BEGIN { printf "%8.2f MiB  in all (%s)\n", s / 1048576, d }'
[[ $total -le $limit ]] || die "the wheels take $total bytes, over 64 MiB"
