#!/usr/bin/env bash
# One device-machine session: environment, GPU tests, then the benchmarks, logs under $OUT.
#   bash benchmarks/gpu_session.sh [tests|bench|all] [extra pytest args...]
# Carried wheels (lark) are installed into /tmp/site first; the machine has torch and triton.
set -uo pipefail
OUT="${OUT:-./out}"; mkdir -p "$OUT"
what="${1:-all}"; shift || true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 FLEXATTN_CACHE_DIR=/tmp/flexattn-cache
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton, datetime
p = torch.cuda.get_device_properties(0)
print(datetime.date.today(), p.name, f"SMs={p.multi_processor_count}", f"torch={torch.__version__}", f"triton={triton.__version__}")
PY
if [[ "$what" == tests || "$what" == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ "$what" == bench || "$what" == all ]]; then
  for b in benchmarks/bench_attention.py benchmarks/bench_decode.py benchmarks/bench_block_mask.py; do
    [[ -f "$b" ]] || continue
    echo "== $b"
    args=(); [[ "$b" == *bench_attention.py ]] && args=(--rounds 3)
    timeout 300 python3 "$b" ${args[@]+"${args[@]}"} 2>&1 | tee "$OUT/$(basename "$b" .py).log" | tail -30
  done
fi
