#!/usr/bin/env bash
# Serve a model or a registered VPO checkpoint with vLLM.
#
# Two modes:
#   openai (default)  `vllm serve`: an OpenAI-compatible API (/v1/completions, /v1/chat/completions)
#                     for the OpenEvolve bridge and test-time search (pipelines.yaml search.server_url).
#   --trl             `trl vllm-serve`: TRL's generation server for training with
#                     trainer.use_vllm=true, trainer.vllm_mode=server and
#                     trainer.vllm_server_base_url=http://HOST:PORT (a server you run yourself; with
#                     execution.vllm_gpus the train stage starts and stops one itself: docs/nodes.md).
#
# Usage:
#   infra/vllm/serve.sh [options] MODEL                 MODEL: hub id or local checkpoint folder
#   infra/vllm/serve.sh [options] --registry URL --entry HASH
#                       fetch a registered checkpoint (hash-verified) into $VPO_CACHE, then serve it
# Options:
#   --trl                 TRL server mode instead of the OpenAI API
#   --host H              bind address (default 127.0.0.1; 0.0.0.0 inside a container)
#   --port P              default 8000
#   --tp N                tensor-parallel size (default 1)
#   --name NAME           served model name for the OpenAI API (default: vpo)
#   --max-model-len N     context length limit
#   --gpu-mem F           GPU memory fraction (default 0.90)
#   --dtype D             auto|bfloat16|float16 (default auto)
#   --dry-run             print the command (one argument per line) instead of running it
# Secrets: the API key is read by vLLM from VLLM_API_KEY in the environment (never put on the
# command line, where `ps` and logs would show it); S3 keys for --registry come from AWS_*.
set -euo pipefail

mode=openai host=127.0.0.1 port=8000 tp=1 name=vpo max_len="" gpu_mem=0.90 dtype=auto
model="" registry="" entry="" dry_run=0
python_bin="${PYTHON:-python}"
cache="${VPO_CACHE:-${HOME:-/tmp}/.cache/vpo/checkpoints}"

die() { echo "serve.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --trl) mode=trl; shift ;;
    --host) host="${2:?--host needs a value}"; shift 2 ;;
    --port) port="${2:?--port needs a value}"; shift 2 ;;
    --tp) tp="${2:?--tp needs a value}"; shift 2 ;;
    --name) name="${2:?--name needs a value}"; shift 2 ;;
    --max-model-len) max_len="${2:?--max-model-len needs a value}"; shift 2 ;;
    --gpu-mem) gpu_mem="${2:?--gpu-mem needs a value}"; shift 2 ;;
    --dtype) dtype="${2:?--dtype needs a value}"; shift 2 ;;
    --registry) registry="${2:?--registry needs a value}"; shift 2 ;;
    --entry) entry="${2:?--entry needs a value}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) [[ -z "$model" ]] || die "more than one MODEL given"; model="$1"; shift ;;
  esac
done

[[ "$port" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"
[[ "$tp" =~ ^[0-9]+$ ]] || die "--tp must be a number, got '$tp'"

if [[ -n "$registry$entry" ]]; then
  [[ -n "$registry" && -n "$entry" ]] || die "--registry and --entry go together"
  [[ -z "$model" ]] || die "give either MODEL or --registry/--entry, not both"
  model="$cache/$entry"
  fetch=("$python_bin" -m vpo.pipeline.cli registry fetch --registry "$registry" "$entry" "$model")
  if [[ $dry_run -eq 1 ]]; then
    printf '%s\n' "${fetch[@]}"; echo "--"
  else
    "${fetch[@]}" >&2
  fi
fi
[[ -n "$model" ]] || die "no MODEL given (see --help)"

if [[ "$mode" == trl ]]; then
  cmd=(trl vllm-serve --model "$model" --host "$host" --port "$port"
       --tensor_parallel_size "$tp" --gpu_memory_utilization "$gpu_mem" --dtype "$dtype")
  [[ -z "$max_len" ]] || cmd+=(--max_model_len "$max_len")
else
  cmd=(vllm serve "$model" --host "$host" --port "$port" --served-model-name "$name"
       --tensor-parallel-size "$tp" --gpu-memory-utilization "$gpu_mem" --dtype "$dtype"
       --generation-config vllm)
  [[ -z "$max_len" ]] || cmd+=(--max-model-len "$max_len")
fi

if [[ "$mode" == trl ]]; then
  url_host="$host"; [[ "$url_host" != 0.0.0.0 ]] || url_host=127.0.0.1
  echo "serve.sh: train against it with --set trainer.use_vllm=true --set trainer.vllm_mode=server" \
       "--set trainer.vllm_server_base_url=http://$url_host:$port" >&2
fi
if [[ $dry_run -eq 1 ]]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
exec "${cmd[@]}"
