#!/usr/bin/env bash
# Every GPU figure of the kernels issue, in stages that each fit a 10-minute slot:
#
#   bash bench/gpu.sh [STAGE...] [-o DIR]     stages: tests kernels model graph parallel (default: all)
#   bash bench/gpu.sh smoke [-o DIR]          the short check: first CUDA figures in < 8 minutes
#   bash bench/gpu.sh smoke --dry-run         check the smoke plan on any machine (CI runs it)
#
#   smoke    on a GPU machine with nothing but the repository and .whl/ (the gguf wheel, see
#            bench/README.md): installs the wheels and kvrun, then bench/gpu_smoke.py: the
#            kernel, graph and packed-CUDA tests compiled for real, bench/kernel_speed.py --check
#            and the 32k decode kernels, kvrun bench on llama3-8b-synthetic (bf16 and q4,
#            with and without CUDA graphs, -np 8), all in at most 8 files in DIR with a
#            markdown summary. It needs no model file. Runs alone (not with other stages).
#   tests    the kernel, graph and end-to-end tests on CUDA (compiled Triton, bf16 included)
#   kernels  bench/kernel_speed.py --check, then GB/s of dense and KIVI-2/4 decode at 8k/32k/128k
#   model    kvrun bench, Llama-3-8B shapes (random weights): full, kivi2, minikv at depth
#            0, 8192, 32768; full also with --cuda-graph
#   graph    the default model (SmolLM2-135M): decode tok/s with and without the CUDA graph,
#            one sequence and --parallel 8
#   parallel kvrun bench on Llama-3-8B shapes (random weights): 64 tokens decoded after 1,000
#            at --parallel 1, 8, 32, full and snapkv, with CUDA graphs (aggregate tok/s);
#            then bench/parallel_batch.py on the default model (real text), N = 1, 8, 32
#
# Output goes to DIR (default $OUT if set, else bench/gpu-results): one file per command
# (JSON where the command has --json; kvrun bench's also as a markdown table, NAME.md), the
# command lines in commands.txt, the GPU in gpu.txt. Copy the figures into bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/gpu-results}
if [ "${1:-}" = smoke ]; then
  shift
  dry=
  while [ $# -gt 0 ]; do
    case $1 in
      -o) out=$2; shift 2 ;;
      --dry-run) dry=1; shift ;;
      *) echo "bench/gpu.sh smoke: unknown flag '$1' (-o DIR, --dry-run)" >&2; exit 2 ;;
    esac
  done
  py=$(command -v python3 || command -v python)
  [ -n "$dry" ] && exec "$py" bench/gpu_smoke.py --dry-run
  if compgen -G ".whl/*.whl" > /dev/null; then  # carried wheels (gguf): into a site of their own
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/kvrun-site .whl/*.whl || { echo "bench/gpu.sh: installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/kvrun-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # kvrun itself: an editable install (what CI does), else the source tree made importable
  "$py" -c "import kvrun.kernels" 2> /dev/null \
    || "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 \
    || for d in kernels convert prompts; do ln -sfn "../$d" "kvrun/$d"; done
  "$py" -c "import gguf, kvrun.kernels" || { echo "bench/gpu.sh: gguf or kvrun does not import; carry .whl/ (bench/README.md)" >&2; exit 1; }
  exec "$py" bench/gpu_smoke.py -o "$out"
fi
stages=()
while [ $# -gt 0 ]; do
  case $1 in
    -o) out=$2; shift 2 ;;
    tests|kernels|model|graph|parallel) stages+=("$1"); shift ;;
    smoke) echo "bench/gpu.sh: smoke runs alone: bash bench/gpu.sh smoke [-o DIR] [--dry-run]" >&2; exit 2 ;;
    *) echo "bench/gpu.sh: unknown stage or flag '$1' (stages: smoke tests kernels model graph parallel; -o DIR)" >&2; exit 2 ;;
  esac
done
[ ${#stages[@]} -eq 0 ] && stages=(tests kernels model graph parallel)
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv \
  > "$out/gpu.txt" 2>&1 || { echo "bench/gpu.sh: no NVIDIA GPU (nvidia-smi failed)" >&2; exit 1; }
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"
date -u +%FT%TZ >> "$out/gpu.txt"
status=0
run() {  # run NAME CMD...: stdout to $out/NAME.txt and the terminal, the command line to
  local name=$1; shift  # commands.txt; a failure is recorded and the next command runs
  echo "$name: $*" | tee -a "$out/commands.txt" >&2
  "$@" | tee "$out/$name.txt" || { status=1; echo "$name FAILED" | tee -a "$out/commands.txt" >&2; }
}
for s in "${stages[@]}"; do
  case $s in
    tests)
      run tests python -m pytest -q -rs tests/test_kernels.py tests/test_kernels_merged.py \
        tests/test_kernels_codebook.py tests/test_kernels_e2e.py tests/test_graph.py \
        tests/test_graph_batch.py ;;
    kernels)
      run check python bench/kernel_speed.py --check
      run kernels python bench/kernel_speed.py --contexts 8192,32768,131072 --json ;;
    model)
      m=(-m llama3-8b-synthetic -c 33408 -n 128 -d 0,8192,32768 -r 3)
      run model kvrun bench "${m[@]}" --kv full --kv kivi2 --kv minikv --json
      run model_graph kvrun bench "${m[@]}" --kv full --cuda-graph --json ;;
    graph)
      run graph_off kvrun bench -p 0 -n 128 -d 0,4096 -r 5 --kv full --json
      run graph_on kvrun bench -p 0 -n 128 -d 0,4096 -r 5 --kv full --cuda-graph --json
      run graph_off_n8 kvrun bench -p 0 -n 128 -d 0,4096 -r 3 --kv full --parallel 8 --json
      run graph_on_n8 kvrun bench -p 0 -n 128 -d 0,4096 -r 3 --kv full --parallel 8 --cuda-graph --json ;;
    parallel)
      for n in 1 8 32; do
        run model_parallel_n$n kvrun bench -m llama3-8b-synthetic -p 1000 -n 64 -r 2 \
          --kv full --kv snapkv --parallel $n --cuda-graph --json
      done
      run parallel python bench/parallel_batch.py --docs 32 --parallel 1,8,32 --cuda-graph \
        --out "$out/parallel.md" ;;
  esac
done
for f in "$out"/model*.txt "$out"/graph_*.txt; do  # kvrun bench JSON -> its markdown table
  [ -s "$f" ] && python -c 'import json, sys; from kvrun.cli.bench import markdown
print(markdown(json.load(open(sys.argv[1]))))' "$f" > "${f%.txt}.md" 2>/dev/null
done
echo "results in $out" >&2
exit $status
