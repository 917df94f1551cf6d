#!/usr/bin/env bash
# The main job end to end on CPU, as far as the toolkit goes today. Run through `make demo`.
set -euo pipefail
export HF_HUB_OFFLINE=1 WANDB_MODE=offline

echo "== dmt estimate: Llama 3.1 70B on 64 x H100, ZeRO-3, full recompute"
dmt estimate --model llama-3.1-70b --gpus 64 --gpu h100-80gb --zero 3 --recompute full --seq-len 8192

echo
echo "== dmt estimate: the same model with Megatron-Core TP=8 PP=4 VPP=2, sequence parallel, distributed optimizer"
dmt estimate --model llama-3.1-70b --gpus 64 --backend megatron --tp 8 --pp 4 --vpp 2 --sequence-parallel \
  --distributed-optimizer --seq-len 8192 --global-batch 512 --recompute selective

echo
echo "== dmt estimate --json (the contract other tools read)"
dmt estimate --model mixtral-8x7b --gpus 16 --backend megatron --ep 8 --tp 2 --distributed-optimizer --json \
  | python -c "import json,sys; r=json.load(sys.stdin); print({k: r[k] for k in ('params','memory_bytes','fits')})"
