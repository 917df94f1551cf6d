#!/usr/bin/env bash
# The main job end to end on CPU: estimate, plan, generate, train on 2 ranks and report the run against its
# prediction, calibrate on that run, verify, convert, restore-test and predict its reference run with the calibration;
# then
# the same recipe shape on Megatron-Core at TP=2 and its checkpoint back to HF; then QLoRA fine-tuning and merge-lora.
# Run through `make demo` (which creates .venv first). Everything goes under runs/demo.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
OUT=runs/demo
rm -rf "$OUT" && mkdir -p "$OUT"

losses() {  # losses RUN_DIR TEXT: TEXT ({steps} filled in), then the run's first and last loss (its step records)
  python - "$1" "$2" <<'PY'
import sys
from pathlib import Path

from toolkit.runtime.metrics import read_metrics

rows = read_metrics(Path(sys.argv[1]))
print(f"{sys.argv[2].format(steps=rows[-1]['step'])} {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
PY
}

echo "== 1. dmt estimate: Llama 3.1 70B on 64 x H100, ZeRO-3, full recompute"
dmt estimate --model llama-3.1-70b --gpus 64 --gpu h100-80gb --zero 3 --recompute full --seq-len 8192

echo; echo "== 2. dmt plan: the fastest layouts for the same job (memory plot in $OUT/plan.png)"
dmt plan --model llama-3.1-70b --gpus 64 --gpu h100-80gb --seq-len 8192 --global-batch 512 --top 5 --plot "$OUT/plan.png"

echo; echo "== 3. dmt generate: launch files for the tiny CPU recipe, predicted for this host (cluster.gpu: cpu)"
dmt generate recipes/tiny-llama-cpu.yaml --out "$OUT/config"
dmt validate "$OUT/config/deepspeed.json" --world-size 2 --trainer-args "$OUT/config/trainer_args.json"

echo; echo "== 4. deepspeed --num_gpus 2 --module toolkit.train --plan $OUT/config/plan.json (2 CPU ranks, gloo, ZeRO-2),"
echo "      then dmt report: what the run measured against what step 3 predicted for it"
# train.py trains the generated files (plan.json, deepspeed.json, trainer_args.json), and refuses if they no longer
# match the recipe; $OUT/config/launch.sh runs the same command under deepspeed, accelerate or torchrun
deepspeed --num_gpus 2 --module toolkit.train --plan "$OUT/config/plan.json" --output-dir "$OUT/run" > "$OUT/train.log" 2>&1 \
  || { tail -30 "$OUT/train.log"; exit 1; }
losses "$OUT/run" "trained {steps} steps: loss"
dmt report "$OUT/run"
echo "   dmt calibrate: the step-time model fitted to this run (one run: the compute scale alone); step 7 predicts the"
echo "   next launch of this plan with it"
dmt calibrate "$OUT/run" --out "$OUT/calibration.yaml"

echo; echo "== 5. dmt ckpt verify / inspect the latest checkpoint"
LATEST="$OUT/run/$(cat "$OUT/run/latest")"
dmt ckpt verify "$LATEST" --deep
dmt ckpt inspect "$LATEST"

echo; echo "== 6. dmt convert zero-to-hf, then load it with transformers"
dmt convert zero-to-hf "$LATEST" "$OUT/hf"
python -c "
from transformers import AutoModelForCausalLM, AutoTokenizer
model, tok = AutoModelForCausalLM.from_pretrained('$OUT/hf'), AutoTokenizer.from_pretrained('$OUT/hf')
ids = tok('The engineer saves a checkpoint', return_tensors='pt').input_ids
print('HF model loads; loss on a sentence:', round(float(model(input_ids=ids, labels=ids).loss), 3))"

echo; echo "== 7. dmt restore-test: kill after a save, resume, compare to the bit"
dmt restore-test --recipe recipes/tiny-llama-cpu.yaml --steps 10 --save-at 5 --workdir "$OUT/restore"
echo "   dmt report --calibration: the restore test's reference run (step 4's plan, launched again) predicted with the"
echo "   calibration fitted on step 4's run, beside what its launch predicted uncalibrated; how close to expect:"
sed -n 's/^Held-out error of the CPU calibration/   &/p' benchmarks/calibration_cpu.md
dmt report "$OUT/restore/reference" --calibration "$OUT/calibration.yaml"

echo; echo "== 8. Megatron-Core at TP=2 from prepared tokens: dmt data prepare the tiny corpus (with the tokenizer"
echo "      step 4 trained), the Megatron recipe on that blend, dmt generate, the generated launch.sh (torchrun, gloo)"
mkdir -p "$OUT/data"
dmt data prepare --input recipes/data/tiny_corpus.txt --tokenizer "$OUT/run/tokenizer" \
  --output-prefix "$OUT/data/tiny" --append-eod --workers 2
dmt data inspect "$OUT/data/tiny" | head -8
python - "$OUT" <<'PY'
import sys
from pathlib import Path

import yaml

out = Path(sys.argv[1]).resolve()
recipe = yaml.safe_load(Path("recipes/tiny-llama-megatron-cpu.yaml").read_text())
recipe["data"] = {"blend": [{"prefix": str(out / "data" / "tiny"), "weight": 1.0}], "split": "98,2,0",
                  "tokenizer": {"path": str(out / "run" / "tokenizer")}}
(out / "megatron-blend.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
PY
dmt generate "$OUT/megatron-blend.yaml" --out "$OUT/megatron-config" --tp 2 > /dev/null
grep -e "--data-path" -e "--split" "$OUT/megatron-config/megatron_args.txt"
dmt validate "$OUT/megatron-config/megatron.yaml" --world-size 2
OMP_NUM_THREADS=1 OUTPUT_DIR="$OUT/megatron" bash "$OUT/megatron-config/launch.sh" torchrun --save-steps 10 \
  > "$OUT/megatron.log" 2>&1 || { tail -30 "$OUT/megatron.log"; exit 1; }
losses "$OUT/megatron" "trained {steps} steps at TP=2 from the blend: loss"

echo; echo "== 9. dmt convert megatron-to-hf, then compare logits with Megatron-Core at TP=2"
export PYTHONWARNINGS=ignore  # Megatron-Core warns at import that Apex and Transformer Engine are absent (CPU)
dmt convert megatron-to-hf "$OUT/megatron/checkpoint-30" "$OUT/megatron-hf"
OMP_NUM_THREADS=1 dmt convert check "$OUT/megatron-hf" "$OUT/megatron/checkpoint-30" --tp 2

echo; echo "== 10. Fine-tuning: QLoRA (4-bit nf4 base, bitsandbytes on CPU) on prompt/completion data, ZeRO-3, 2 ranks"
dmt estimate --model llama-3.1-70b --gpus 8 --zero 3 --recompute full --finetune qlora --lora-r 16
dmt generate recipes/tiny-llama-qlora-cpu.yaml --out "$OUT/qlora-config" > /dev/null
# the generated deepspeed.json fixes the schedule's length (30 steps): train.py refuses a --max-steps against it
deepspeed --num_gpus 2 --module toolkit.train --plan "$OUT/qlora-config/plan.json" --output-dir "$OUT/qlora" \
  > "$OUT/qlora.log" 2>&1 || { tail -30 "$OUT/qlora.log"; exit 1; }
losses "$OUT/qlora" "trained the adapters {steps} steps: loss on the completions"
dmt convert merge-lora "$OUT/qlora/base" "$OUT/qlora/checkpoint-30" "$OUT/qlora-merged"
