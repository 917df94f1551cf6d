"""HF safetensors <-> Megatron-Core dist checkpoints, through the family tables in `toolkit.mappings`.

Megatron-Core writes and reads the checkpoint itself: the converter builds a `GPTModel` (TP=1, PP=1, local layer
spec, CPU) in a one-process gloo group, fills it from the HF tensors through the family's weight table and saves its
`sharded_state_dict()` with `dist_checkpointing` (torch_dist). Such a checkpoint is reshardable: Megatron-Core loads
it at any TP/PP/VPP/EP whose padded vocabulary matches, which is why `--tp` sets the padding (128 x tp rows). The
reverse direction loads the dist checkpoint into the same TP=1 model and splits the fused tensors back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.backends.megatron_checkpoint import FORMAT
from toolkit.checkpoint.atomic import atomic_directory
from toolkit.errors import UserInputError

log = logging.getLogger(__name__)
HF_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class MegatronConversion:
    out_dir: Path
    tensors: int
    parameters: int
    layout: dict
    padded_vocab: int


def read_hf_config(path: Path, flag: str) -> dict:
    config_path = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(config_path.read_text())
    except FileNotFoundError:
        raise UserInputError(flag, f"{config_path} not found: an HF model directory holds config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UserInputError(flag, f"{config_path} is not a readable JSON config ({exc})") from None


def check_layout(hf_config: dict, tp: int, pp: int, vpp: int, ep: int) -> None:
    """The layout rules of `toolkit.spec.plan` (heads and kv groups by TP, layers by PP x VPP, experts by EP)."""
    from toolkit.spec.model import spec_from_hf_dict
    from toolkit.spec.plan import resolve_plan

    model = spec_from_hf_dict(hf_config, hf_config.get("model_type", "model"))
    resolve_plan(model, tp * pp * ep, backend="megatron", gpus_per_node=tp * pp * ep, tp=tp, pp=pp, vpp=vpp, ep=ep,
                 micro_batch=1, seq_len=min(128, model.max_position_embeddings or 128))


def megatron_model_config(hf_config: dict, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
                          padded_vocab: int | None = None) -> dict:
    """The megatron.yaml sections a GPTModel of this HF config needs (fp32, CPU initialisation, local layer spec)."""
    from toolkit.estimate.params import megatron_padded_vocab
    from toolkit.mappings import megatron_fields

    sections = megatron_fields(hf_config)
    vocab = sections["model"]["vocab_size"]
    return {
        "schedule": {"seed": 0},
        "model": {"family": hf_config["model_type"], "vocab_size": vocab},
        "transformer_config": {**sections["transformer_config"], "tensor_model_parallel_size": tp,
                               "pipeline_model_parallel_size": pp,
                               "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None,
                               "context_parallel_size": 1, "expert_model_parallel_size": ep,
                               "use_cpu_initialization": True, "transformer_impl": "local"},
        "gpt_model": {**sections["gpt_model"], "vocab_size": padded_vocab or megatron_padded_vocab(vocab, tp)},
    }


@contextlib.contextmanager
def single_process_group():
    """A one-rank gloo group (a file store, no port) for Megatron-Core's save/load, unless one exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="dmt-pg-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def megatron_model(config: dict):
    """A GPTModel (one chunk, this rank's part at the config's layout) inside Megatron-Core's process groups."""
    from toolkit.backends.megatron_build import build_model_chunks, destroy, initialize_parallel, transformer_config
    from toolkit.backends.megatron_core import device_context

    with device_context():
        initialize_parallel(config)
        try:
            chunks = build_model_chunks(config, transformer_config(config))
            yield chunks[0] if len(chunks) == 1 else chunks
        finally:
            destroy()


class HFTensors:
    """Read-on-demand access to the tensors of an HF safetensors model (one file or sharded with an index)."""

    def __init__(self, hf_dir: Path):
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (hf_dir / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(hf_dir / "model.safetensors", "pt") as handle:
                weight_map = {name: "model.safetensors" for name in handle.keys()}
        else:
            raise UserInputError("HF_DIR", f"{hf_dir} has no model.safetensors or model.safetensors.index.json")
        self.hf_dir, self.weight_map = hf_dir, weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __getitem__(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise UserInputError("HF_DIR", f"tensor {name} is missing from {self.hf_dir}")
        with safe_open(self.hf_dir / self.weight_map[name], "pt") as handle:
            return handle.get_tensor(name)


def hf_to_megatron(hf_dir: Path, out_dir: Path, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
                   progress: bool = False) -> MegatronConversion:
    """HF safetensors -> a Megatron-Core dist checkpoint that loads at tp/pp/vpp/ep (and other layouts of the same
    vocabulary padding), with config.json beside it and a manifest."""
    import shutil

    hf_config = read_hf_config(hf_dir, "HF_DIR")
    check_layout(hf_config, tp, pp, vpp, ep)
    import torch
    from megatron.core import dist_checkpointing
    from tqdm import tqdm

    from toolkit.checkpoint.manifest import write_manifest
    from toolkit.mappings import to_megatron_state_dict

    config = megatron_model_config(hf_config)  # built whole (TP=1): the vocabulary padded for --tp
    config["gpt_model"]["vocab_size"] = megatron_model_config(hf_config, tp=tp)["gpt_model"]["vocab_size"]
    padded = config["gpt_model"]["vocab_size"]
    source = HFTensors(hf_dir)
    with atomic_directory(out_dir) as tmp, single_process_group(), megatron_model(config) as model:
        state = to_megatron_state_dict(hf_config, source)
        targets = model.state_dict(keep_vars=True)
        unknown = sorted(set(state) - set(targets))
        missing = sorted(k for k in set(targets) - set(state) if not k.endswith("_extra_state"))
        if unknown or missing:
            raise AssertionError(f"the {hf_config['model_type']} table does not match GPTModel: "
                                 f"unknown {unknown[:5]}, missing {missing[:5]}")
        total = sum(t.numel() * t.element_size() for t in state.values())
        with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, desc="hf-to-megatron",
                                   disable=not progress) as bar:
            for name, tensor in state.items():
                bar.update(tensor.numel() * tensor.element_size())
                target = targets[name]
                if target.shape[0] != tensor.shape[0] and name in PADDED:  # vocabulary rows: zeros past the end
                    target.zero_()
                    target[: tensor.shape[0]].copy_(tensor)
                else:
                    target.copy_(tensor)
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp))
        parameters = sum(t.numel() for t in state.values())
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for side in HF_SIDE_FILES:
            if (hf_dir / side).is_file():
                shutil.copyfile(hf_dir / side, tmp / side)
        layout = {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "padded_vocab": padded}
        write_manifest(tmp, step=0, world_size=1, layout=layout, fmt=FORMAT,
                       extra={"converted_from": str(hf_dir.resolve())})
    log.info("wrote %s (%d tensors, %d parameters)", out_dir, len(state), parameters)
    return MegatronConversion(out_dir, len(state), parameters, layout, padded)


PADDED = ("embedding.word_embeddings.weight", "output_layer.weight")


def checkpoint_vocab(ckpt: Path) -> int:
    """Rows of the embedding in a dist checkpoint (the padded vocabulary it was saved with)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserInputError("MEGATRON_DIR", f"{ckpt} is not a Megatron-Core torch_dist checkpoint ({exc})") from None
    entry = metadata.state_dict_metadata.get(PADDED[0])
    if entry is None:
        raise UserInputError("MEGATRON_DIR", f"{ckpt} holds no {PADDED[0]}: not a GPTModel checkpoint")
    return int(entry.size[0])


def load_weights(model, ckpt: Path) -> None:
    """This rank's part of the model from a dist checkpoint, resharded by Megatron-Core to the model's layout (a
    training checkpoint also holds optimizer and scheduler state: only the model's keys are read)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt))
    except (CheckpointingException, CheckpointException) as exc:  # torch's wraps each rank's failure
        reason = str(exc).strip().splitlines()[-1].split("Exception: ")[-1]  # torch's carries the rank's traceback
        raise UserInputError("MEGATRON_DIR", f"{ckpt} does not hold this model's weights: {reason[:300]}") from None
    model.load_state_dict(loaded, strict=False)


def load_megatron_state(ckpt: Path, hf_config: dict) -> dict:
    """The whole (TP=1) GPTModel state dict of a dist checkpoint."""
    config = megatron_model_config(hf_config, padded_vocab=checkpoint_vocab(ckpt))
    with single_process_group(), megatron_model(config) as model:
        load_weights(model, ckpt)
        return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def megatron_to_hf(ckpt: Path, out_dir: Path, config: Path | None = None, dtype: str = "fp32",
                   progress: bool = False) -> dict:
    """A Megatron-Core dist checkpoint -> HF safetensors + config.json."""
    import shutil

    import torch
    from tqdm import tqdm

    from toolkit.checkpoint.safetensors_stream import StreamingSafetensorsWriter, tensor_bytes
    from toolkit.mappings import to_hf_state_dict

    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if out_dtype is None:
        raise UserInputError("--dtype", f"must be fp32 or bf16, got {dtype}")
    if not ckpt.is_dir():
        raise UserInputError("MEGATRON_DIR", f"{ckpt} is not a directory")
    config_path = config or ckpt / "config.json"
    if not config_path.is_file():
        raise UserInputError("--config", f"{ckpt} has no config.json beside the checkpoint; pass the model's HF "
                                         f"config.json with --config")
    hf_config = read_hf_config(config_path, "--config")
    state = to_hf_state_dict(hf_config, load_megatron_state(ckpt, hf_config))
    layout = [(name, tuple(t.shape), out_dtype) for name, t in state.items()]
    with atomic_directory(out_dir) as tmp:
        writer = StreamingSafetensorsWriter(tmp / "model.safetensors", layout)
        with tqdm(total=sum(tensor_bytes(shape, dt) for _, shape, dt in layout), unit="B", unit_scale=True,
                  desc="megatron-to-hf", disable=not progress) as bar:
            for name, tensor in state.items():
                bar.update(writer.write(name, tensor.to(out_dtype)))
        writer.close()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for side in HF_SIDE_FILES:
            if (ckpt / side).is_file():
                shutil.copyfile(ckpt / side, tmp / side)
    return {"out_dir": str(out_dir), "tensors": len(state), "parameters": sum(t.numel() for t in state.values())}
