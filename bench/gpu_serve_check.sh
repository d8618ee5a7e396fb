#!/bin/bash
# The HTTP server on CUDA, end to end: a Qwen3-0.6B-shaped model with random weights (config
# only, nothing downloaded), nano-vllm's workload (256 requests, 100..1024 tokens in and
# out, ignore_eos, temperature 0.6) through `pagedserve bench`, a bad request, then
# /metrics. Run from the repo root on a CUDA host: `make gpu-serve-check`, or with a
# Python that already has torch, Triton and transformers, `bash bench/gpu_serve_check.sh`
# (wheels of the server's other packages in .whl/ are installed first when present).
# Writes server.log and bench.json to $OUT (else ./gpu_check_out).
set -u
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
MODEL=$(mktemp -d /tmp/gpu_serve_check_XXXX)
$PYTHON - "$MODEL" <<'PY' || exit 1
import sys
from pathlib import Path

import torch
from transformers import Qwen3Config

from bench.gpu_check.common import QWEN3_0_6B
from tests.support.gpu_models import random_model_folder, save_tokenizer

folder = Path(sys.argv[1])
config = Qwen3Config(**QWEN3_0_6B)
random_model_folder(config, folder, torch.bfloat16, torch.device("cuda"))
# its word-level tokenizer over the whole vocabulary, so that every sampled id detokenizes
save_tokenizer(folder, config.vocab_size)
PY
$PYTHON -m server.cli serve --model "$MODEL" --max-model-len 4096 --max-num-seqs 256 \
    --max-num-batched-tokens 16384 --port 8000 > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 300); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
echo "ready after ${i}s"
$PYTHON -m server.cli bench --url http://127.0.0.1:8000 --num-requests 256 --concurrency 256 \
    --input-len 100:1024 --output-len 100:1024 --prompt-token-ids --token-id-range 1:10000 \
    --ignore-eos --temperature 0.6 --seed 0 --timeout 600 --json | tee "$OUT/bench.json"
echo "a bad request:"
curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
    -d '{"prompt": [1, 2, 3], "max_tokens": -1}' -w ' HTTP %{http_code}\n'
curl -s localhost:8000/metrics | grep -E "^pagedserve_" | grep -v -E "_bucket|_created"
kill $SERVER
wait $SERVER
rm -rf "$MODEL"
