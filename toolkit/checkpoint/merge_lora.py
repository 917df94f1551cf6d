"""`dmt convert merge-lora BASE ADAPTER OUT`: a LoRA adapter merged into its base, as HF safetensors, tensor by tensor.

Each adapted weight becomes W + (B @ A) x scaling exactly as PEFT's `merge_and_unload()` computes it
(peft/tuners/lora/layer.py, Linear.get_delta_weight and merge): the adapter in fp32 (PeftModel.from_pretrained upcasts
bf16/fp16 adapters), B @ A transposed for fan_in_fan_out modules (GPT-2's Conv1D), scaled by alpha / r (alpha /
sqrt(r) with rsLoRA), then added in place to the base weight in its own dtype. Every other tensor's bytes are copied
by the kernel. Peak memory is the largest weight and its adapter, not the model.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

from toolkit.checkpoint.atomic import atomic_directory, check_output_dir
from toolkit.checkpoint.hf_config import SIDE_FILES
from toolkit.checkpoint.safetensors_stream import ShardedSafetensorsWriter, parse_size, safetensors_weight_map
from toolkit.errors import UserInputError
from toolkit.numeric import is_finite_number
from toolkit.readers import read_json, read_safetensors_header

log = logging.getLogger(__name__)
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _adapter_settings(adapter_dir: Path) -> tuple[float, bool]:
    """(scaling, fan_in_fan_out) of a plain LoRA adapter; variants whose merge is more than W + s B A are refused."""
    config = read_json(adapter_dir / ADAPTER_CONFIG, "ADAPTER", what="PEFT's adapter_config.json")
    if config.get("peft_type") != "LORA":
        raise UserInputError("ADAPTER", f"{adapter_dir / ADAPTER_CONFIG}: peft_type is {config.get('peft_type')!r}, "
                                        f"not LORA")
    for key, why in (("use_dora", "DoRA rescales the merged weight"), ("rank_pattern", "per-module ranks"),
                     ("alpha_pattern", "per-module alphas"), ("modules_to_save", "fully trained module copies"),
                     ("lora_bias", "adapter biases")):
        if config.get(key):
            raise UserInputError("ADAPTER", f"{adapter_dir / ADAPTER_CONFIG}: {key} is set ({why}); merge it with "
                                            f"PEFT's merge_and_unload()")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or not is_finite_number(alpha):
        raise UserInputError("ADAPTER", f"{adapter_dir / ADAPTER_CONFIG}: r must be a positive integer and lora_alpha "
                                        f"a finite number, got r {r!r}, lora_alpha {alpha!r}")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return scaling, bool(config.get("fan_in_fan_out"))


def _adapter_pairs(adapter_dir: Path) -> dict[str, tuple[str, str]]:
    """Base weight name -> (lora_A name, lora_B name) in the adapter file."""
    names = read_safetensors_header(adapter_dir / ADAPTER_FILE, "ADAPTER")
    pairs = {}
    for name in names:
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removesuffix(".lora_A.weight")
        partner = f"{module}.lora_B.weight"
        if partner not in names:
            raise UserInputError("ADAPTER", f"{adapter_dir / ADAPTER_FILE}: {name} has no {partner}")
        pairs[module.removeprefix(PEFT_PREFIX) + ".weight"] = (name, partner)
    if not pairs:
        raise UserInputError("ADAPTER", f"{adapter_dir / ADAPTER_FILE} holds no lora_A / lora_B tensors")
    return pairs


def merged_weight(weight, lora_a, lora_b, scaling: float, fan_in_fan_out: bool):
    """PEFT's merge of one module: the fp32 delta added in place to a copy of the base weight (its dtype kept)."""
    delta = lora_b.float() @ lora_a.float()
    delta = (delta.T if fan_in_fan_out else delta) * scaling
    merged = weight.clone()
    merged += delta
    return merged


def merge_lora(base_dir: Path, adapter_dir: Path, out_dir: Path, max_shard_size: str = "5GB") -> dict:
    import torch
    from safetensors import safe_open

    max_bytes = parse_size(max_shard_size)
    check_output_dir(out_dir, inputs=[base_dir, adapter_dir])
    for path, flag in ((base_dir / "config.json", "BASE"), (adapter_dir / ADAPTER_FILE, "ADAPTER"),
                       (adapter_dir / ADAPTER_CONFIG, "ADAPTER")):
        if not path.is_file():
            raise UserInputError(flag, f"{path} does not exist")
    weight_map = safetensors_weight_map(base_dir, "BASE")
    if weight_map is None:
        raise UserInputError("BASE", f"{base_dir} holds no model.safetensors (or its index): a HF model directory")
    scaling, fan_in_fan_out = _adapter_settings(adapter_dir)
    pairs = _adapter_pairs(adapter_dir)
    missing = sorted(set(pairs) - set(weight_map))
    if missing:
        raise UserInputError("ADAPTER", f"{missing[0]} (adapted) is not a tensor of the base {base_dir}: another base?")
    headers = {file: read_safetensors_header(base_dir / file, "BASE") for file in sorted(set(weight_map.values()))}
    layout = [(name, tuple(headers[file][name]["shape"]), SAFETENSORS_DTYPES[headers[file][name]["dtype"]])
              for name, file in weight_map.items()]
    merged = 0
    with atomic_directory(out_dir, inputs=[base_dir, adapter_dir]) as tmp, \
            safe_open(str(adapter_dir / ADAPTER_FILE), framework="pt") as adapter:
        writer = ShardedSafetensorsWriter(tmp, layout, max_bytes)
        handles: dict[str, object] = {}
        for name, shape, dtype in layout:
            file = weight_map[name]
            if name not in pairs:  # unchanged: its bytes, copied by the kernel
                begin, end = headers[file][name]["data_offsets"]
                start = _data_start(base_dir / file)
                writer.copy_ranges(name, shape, dtype, [(base_dir / file, start + begin, end - begin)])
                continue
            if file not in handles:
                handles[file] = safe_open(str(base_dir / file), framework="pt")
            lora_a, lora_b = (adapter.get_tensor(key) for key in pairs[name])
            weight = handles[file].get_tensor(name)
            expected = (weight.shape[1], weight.shape[0]) if fan_in_fan_out else tuple(weight.shape)
            if (lora_b.shape[0], lora_a.shape[1]) != expected:
                raise UserInputError("ADAPTER", f"{pairs[name][0]} {tuple(lora_a.shape)} and {pairs[name][1]} "
                                                f"{tuple(lora_b.shape)} do not fit {name} {tuple(weight.shape)}")
            result = merged_weight(weight, lora_a, lora_b, scaling, fan_in_fan_out)
            if not bool(torch.isfinite(result).all()):  # nothing is written: the output directory is never made
                if not bool(torch.isfinite(weight).all()):
                    raise UserInputError("BASE", f"{name} holds NaN or infinite values; merging into it gives no model")
                raise UserInputError("ADAPTER", f"merging {name} gives NaN or infinite weights: scaling {scaling:g} "
                                                f"x lora_B @ lora_A does not fit {dtype}")
            writer.write(name, result)
            merged += 1
        writer.close()
        shutil.copyfile(base_dir / "config.json", tmp / "config.json")
        for side in SIDE_FILES:  # the adapter's tokenizer (a training checkpoint's) over the base's
            for folder in (base_dir, adapter_dir):
                if (folder / side).is_file():
                    shutil.copyfile(folder / side, tmp / side)
    log.info("merged %d adapted weights into %s", merged, out_dir)
    return {"out_dir": str(out_dir), "tensors": len(layout), "merged": merged, "scaling": scaling,
            "shards": len(writer.shards)}


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begins: after the 8-byte length and the header it gives."""
    import struct

    with open(path, "rb") as handle:
        return 8 + struct.unpack("<Q", handle.read(8))[0]
