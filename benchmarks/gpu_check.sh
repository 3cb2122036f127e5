#!/usr/bin/env bash
# Everything GPU-side in one run (under 8 minutes on one H200-class GPU): the GRPO/VPO step at a few
# shapes (generation and training timed apart, TFLOP/s and MFU against a bf16 matmul, CUDA memory peaks
# against the memory plan), the training step alone at code-qwen-1gpu-lora's vpo shape, and one-process
# `accelerate launch` runs under FSDP2 and DeepSpeed ZeRO-2. One JSON and one markdown table.
#
#   bash benchmarks/gpu_check.sh                     # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --cpu --tiny        # here, on the CPU, at tiny sizes (a minute or two)
#
# Options: --out DIR (default: $OUT if set, else runs/gpu-check), --wheels DIR (default:
# benchmarks/gpu_wheels, built by `bash benchmarks/gpu_wheels.sh`), --no-wheels (use the interpreter's
# packages as they are: a development checkout), --python PY (default: python3), --only CHECK...
#
# The machine needs python with torch, transformers, accelerate and peft; the rest (vpo itself, DeepSpeed
# and its small dependencies) comes from the wheel folder beside this script, installed with
# `pip install --no-index --no-deps --target` into a folder put first on PYTHONPATH: nothing is
# downloaded. Anything missing stops the run with one line and a non-zero status.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
out="${OUT:-$repo/runs/gpu-check}"
wheels="$here/gpu_wheels"
use_wheels=1
python="python3"
cpu=0
pass=()

die() { echo "error: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --wheels) wheels="${2:?--wheels needs a folder}"; shift 2 ;;
    --no-wheels) use_wheels=0; shift ;;
    --python) python="${2:?--python needs an interpreter}"; shift 2 ;;
    --cpu) cpu=1; pass+=("--cpu"); shift ;;
    --tiny) pass+=("--tiny"); shift ;;
    --only) shift; pass+=("--only"); while [[ $# -gt 0 && "$1" != --* ]]; do pass+=("$1"); shift; done ;;
    --budget) pass+=("--budget" "${2:?--budget needs seconds}"); shift 2 ;;
    -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

command -v "$python" >/dev/null 2>&1 || die "no interpreter $python (pass --python)"
cd "$repo"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# What the machine must already have: one line naming each missing package.
missing="$("$python" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("torch", "transformers", "accelerate", "peft", "yaml", "numpy", "tokenizers")
               if importlib.util.find_spec(m) is None))
EOF
)" || die "$python cannot run"
[[ -z "$missing" ]] || die "missing on this machine: $missing (needs torch, transformers, accelerate, peft)"
if [[ $cpu -eq 0 ]]; then
  "$python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
    || die "no CUDA GPU visible to torch (run with --cpu --tiny on a CPU)"
fi

manifest="$out/wheels.txt"
: > "$manifest"
if [[ $use_wheels -eq 1 ]]; then
  [[ -d "$wheels" ]] || die "no wheel folder $wheels: build it with 'bash benchmarks/gpu_wheels.sh' and copy it beside this script (or pass --no-wheels)"
  shopt -s nullglob
  found=("$wheels"/*.whl)
  shopt -u nullglob
  [[ ${#found[@]} -gt 0 ]] || die "no wheels in $wheels (bash benchmarks/gpu_wheels.sh)"
  for need in vpo deepspeed; do
    compgen -G "$wheels/${need}-*.whl" >/dev/null || die "no $need wheel in $wheels (bash benchmarks/gpu_wheels.sh)"
  done
  "$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip to install the wheels with"
  site="${TMPDIR:-/tmp}/vpo-gpu-check-site"
  rm -rf "$site"
  "$python" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$site" "${found[@]}" >"$out/pip-install.log" 2>&1 \
    || die "pip could not install the wheels in $wheels: $(tail -n 1 "$out/pip-install.log")"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  for w in "${found[@]}"; do echo "$(basename "$w") $(stat -c %s "$w")" >> "$manifest"; done
  bad="$("$python" - <<'EOF'
import importlib
bad = []
for m in ("vpo", "vpo.memory_plan", "vpo.advantages", "deepspeed"):
    try:
        importlib.import_module(m)
    except Exception as exc:  # one line per module that does not import
        bad.append(f"{m} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
print("import-check:" + "; ".join(bad))  # marked: DeepSpeed logs to stdout when imported
EOF
)"
  bad="$(sed -n 's/^import-check://p' <<<"$bad")"
  [[ -z "$bad" ]] || die "installed from $wheels but cannot import: $bad"
fi

exec "$python" "$here/gpu_check.py" --out "$out" --python "$python" --wheels-manifest "$manifest" "${pass[@]}"
