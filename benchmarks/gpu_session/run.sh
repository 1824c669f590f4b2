# The GPU check of a session lent a GPU (benchmarks/gpu_session/prepare.sh wrote .gpu/): set up, then
# benchmarks/gpu_check.py (GPU_ARGS, default --device cuda; GPU_CHECK_S its time limit); logs and JSON to $OUT
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
T0=$(date +%s)
mkdir -p /tmp/site /tmp/csrc && python3 -m zipfile -e .gpu/site.zip /tmp/site && tar -xJf .gpu/csrc.tar.xz -C /tmp/csrc || exit 3
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1 | tee $OUT/env.txt
$PY .gpu/build_native.py /tmp/csrc/cython 2>&1 | tail -5 | tee -a $OUT/env.txt
$PY -W error::RuntimeWarning -c "
import torch, transformers, hydra, omegaconf, hqq, specmd.native as n; n.select()
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'transformers', transformers.__version__, 'native', set(n.STATE.values()))
" 2>&1 | tee -a $OUT/env.txt
echo "setup $(( $(date +%s) - T0 )) s" | tee -a $OUT/env.txt
set -o pipefail
timeout ${GPU_CHECK_S:-500} $PY benchmarks/gpu_check.py ${GPU_ARGS:---device cuda} --out $OUT/gpu.json 2>&1 | grep -v "it/s\]\|layer/s\]" | tee $OUT/gpu.log
echo "rc $? total $(( $(date +%s) - T0 )) s" | tee -a $OUT/env.txt
