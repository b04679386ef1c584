#!/usr/bin/env bash
# Every GPU figure of the kernels issue, in stages that each fit a 10-minute slot:
#
#   bash bench/gpu.sh [STAGE...] [-o DIR]     stages: tests kernels model graph parallel (default: all)
#
#   tests    the kernel, graph and end-to-end tests on CUDA (compiled Triton, bf16 included)
#   kernels  bench/kernels.py --check, then GB/s of dense and KIVI-2/4 decode at 8k/32k/128k
#   model    kvrun bench, Llama-3-8B shapes (random weights): full, kivi2, minikv at depth
#            0, 8192, 32768; full also with --cuda-graph
#   graph    the default model (SmolLM2-135M): decode tok/s with and without the CUDA graph,
#            one sequence and --parallel 8
#   parallel kvrun bench on Llama-3-8B shapes (random weights): 64 tokens decoded after 1,000
#            at --parallel 1, 8, 32, full and snapkv, with CUDA graphs (aggregate tok/s);
#            then bench/parallel.py on the default model (real text), N = 1, 8, 32
#
# Output goes to DIR (default $OUT if set, else bench/gpu-results): one file per command
# (JSON where the command has --json; kvrun bench's also as a markdown table, NAME.md), the
# command lines in commands.txt, the GPU in gpu.txt. Copy the figures into bench/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/gpu-results}
stages=()
while [ $# -gt 0 ]; do
  case $1 in
    -o) out=$2; shift 2 ;;
    tests|kernels|model|graph|parallel) stages+=("$1"); shift ;;
    *) echo "bench/gpu.sh: unknown stage or flag '$1' (stages: tests kernels model graph parallel; -o DIR)" >&2; exit 2 ;;
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
      run check python bench/kernels.py --check
      run kernels python bench/kernels.py --contexts 8192,32768,131072 --json ;;
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
      run parallel python bench/parallel.py --docs 32 --parallel 1,8,32 --cuda-graph \
        --out "$out/parallel.md" ;;
  esac
done
for f in "$out"/model*.txt "$out"/graph_*.txt; do  # kvrun bench JSON -> its markdown table
  [ -s "$f" ] && python -c 'import json, sys; from kvrun.cli.bench import markdown
print(markdown(json.load(open(sys.argv[1]))))' "$f" > "${f%.txt}.md" 2>/dev/null
done
echo "results in $out" >&2
exit $status
