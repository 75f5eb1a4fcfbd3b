#!/usr/bin/env bash
# The checks that need a GPU (issues #13 and #15), run as one script on a lent single-GPU machine:
#   1. predicted vs measured step time and memory, one GPU, examples/gpt.py at GPT-2-medium
#      and GPT-3 XL (1.3B) shapes, bfloat16 (measured CUDA profile -> solve -> planner run,
#      whose step times wait for the GPU before they are taken);
#   2. the 1.3B model again with its linears in FP8 (`planner solve --fp8`, torchao Float8
#      training): FP8 vs BF16, each predicted vs measured;
#   3. analytic (roofline) vs measured unit times at GPT-3 2.7B layer shapes, which checks the
#      GPU preset's matmul efficiency.
# Python packages the machine lacks come as wheels in .whl/ (pydantic, PuLP, typer in .whl/base;
# torchao in .whl/ao17, or .whl/ao16 where 0.17 does not run on the machine's torch). Every
# result goes under $RES and is packed into $OUT/gpu_results.tgz after each step, so what a
# step that runs out of time had finished still comes back.
#
#   GPU=h200 bash benchmarks/gpu_checks.sh                     # every check
#   GPU=h200 bash benchmarks/gpu_checks.sh gpt-1.3b gpt-1.3b-fp8  # these, in this order
set -u
GPU=${GPU:-h200}
RES=${RES:-/tmp/gpu_results}
OUT=${OUT:-$RES}
mkdir -p "$RES" "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=4
pack() { tar czf "$OUT/gpu_results.tgz" -C "$RES" . ; }
step() {  # step NAME SECONDS COMMAND...: run one check with a time limit, keep its log
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" > "$RES/log_$name.txt" 2>&1
    echo "=== $name exit $? ($(date +%T))"; tail -25 "$RES/log_$name.txt"
    pack
}
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
fp8_smoke='import torch, torchao
from torchao.float8 import convert_to_float8_training
m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).cuda()
convert_to_float8_training(m)
with torch.autocast("cuda", dtype=torch.bfloat16):
    m(torch.randn(64, 256, device="cuda")).sum().backward()
print("torchao", torchao.__version__, "Float8 training step ok on", torch.cuda.get_device_name())'

install .whl/base/*.whl .whl/ao17/*.whl
python3 -c "$fp8_smoke" || { rm -rf /tmp/site/torchao*; install .whl/ao16/*.whl; python3 -c "$fp8_smoke"; }
{ nvidia-smi; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|torchao|pydantic|pulp|typer|transformers) "; } > "$RES/environment.txt" 2>&1
cat "$RES/environment.txt"

CHOSEN="$*"
pvm="python3 benchmarks/predicted_vs_measured.py --device cuda --gpu $GPU --gpus 1 --dtype bfloat16 --chains 1 --runs 1 --steps 20 --out $RES"
declare -A CHECK=(
  [gpt2-medium]="170 $pvm --model gpt2-medium --global-batch 16"
  [gpt-1.3b]="200 $pvm --model gpt-1.3b --global-batch 16"
  [gpt-1.3b-fp8]="240 $pvm --model gpt-1.3b --global-batch 16 --pin=--fp8"
  [analytic-2.7b]="120 python3 benchmarks/analytic_vs_measured.py --device cuda --gpu $GPU --preset gpt-2.7b-4l --dtype bfloat16 --micro-batch-sizes 1,2,4 --out-dir $RES --profile-dir $RES"
)
for name in ${CHOSEN:-gpt2-medium gpt-1.3b gpt-1.3b-fp8 analytic-2.7b}; do
    step "$name" ${CHECK[$name]}
done
