"""The memory model of LoRA and QLoRA against what real PEFT models hold per rank under DeepSpeed ZeRO-3 on 2 CPU ranks:
weights (the frozen base's partitions, bf16 or 4-bit with its quantisation state, and the parameters ZeRO-3 keeps
whole), the adapters' gradients and optimizer states, each within 5%.

tests/distributed/lora_probe.py builds the model as the fine-tuning backend does and reads the bytes from DeepSpeed's
live objects after one step. The matrices are large enough (hidden 1024) that the base's 4-bit weights, a quarter of
their elements in bf16 storage, stay above ZeRO-3's persistence threshold (1e5 elements); the adapters are below it,
and the model counts them whole on every rank, as DeepSpeed keeps them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, tiny_llama_config
from toolkit.estimate.memory import estimate_memory
from toolkit.spec.finetune import FinetuneOptions
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

pytestmark = pytest.mark.launch
PROBE = Path(__file__).resolve().parent / "lora_probe.py"
VENV_BIN = Path(sys.executable).parent
CONFIG = tiny_llama_config(hidden_size=1024, intermediate_size=2752, num_hidden_layers=2)
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-probe")
    config = root / "config.json"
    config.write_text(json.dumps(CONFIG))
    found = {}
    for method in ("lora", "qlora"):
        out, log = root / f"{method}.json", root / f"{method}.log"
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(PROBE),
               "--method", method, "--config-json", str(config), "--base", str(root / "base"), "--out", str(out)]
        env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
        with open(log, "w") as handle:
            rc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=600).returncode
        if not out.is_file():  # judged by what it wrote (gloo may abort at exit after the work is done)
            raise AssertionError(f"lora_probe {method} wrote nothing (rc={rc}):\n{log.read_text()[-4000:]}")
        found[method] = (json.loads(out.read_text()), config)
    return found


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_zero3_memory_of_a_peft_model_is_within_5_percent(probes, method):
    records, config = probes[method]
    spec = load_model_spec(str(config))
    plan = resolve_plan(spec, 2, zero=3, seq_len=32, finetune=FinetuneOptions(method=method, r=16, alpha=32))
    predicted = estimate_memory(spec, plan)
    for record in records:
        assert record["trainable"] < record["total"] / 10  # adapters only
        measured = {"weights": record["weights_resident_bytes"] + record["quant_state_bytes"],
                    "gradients": record["gradient_bytes"], "optimizer": record["optimizer_bytes"]}
        for key, value in measured.items():
            expected = getattr(predicted, key)
            print(f"{method} rank {record['rank']} {key}: measured {value:,} predicted {expected:,} "
                  f"({expected / value - 1:+.2%})")
            assert abs(expected / value - 1) <= TOLERANCE, (key, value, expected, record)
