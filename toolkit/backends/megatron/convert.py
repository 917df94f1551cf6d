"""HF safetensors <-> Megatron-Core dist checkpoints, through the family tables in `toolkit.families`, streamed.

Megatron-Core supplies the map: a `GPTModel` (TP=1, PP=1, local layer spec) built on the meta device in a one-process
gloo group gives its `sharded_state_dict()`, the checkpoint key, shape and offset of every weight. hf-to-megatron
writes that torch_dist checkpoint tensor by tensor (dist_writer.py), each tensor made from its memory-mapped HF
tensors by the family's weight table when the writer reaches it; megatron-to-hf reads it back chunk by chunk, splits
the fused tensors and appends them to a safetensors file. No state dict is ever whole in memory. Such a checkpoint
is reshardable: Megatron-Core loads it at any TP/PP/VPP/EP whose padded vocabulary matches, which is why `--tp` sets
the padding (128 x tp rows); training checkpoints (any layout, optimizer state beside the weights) read the same way."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.backends.megatron.build import (
    build_model_chunks,
    destroy,
    device_context,
    initialize_parallel,
    transformer_config,
)
from toolkit.backends.megatron.dist_writer import MANIFEST_FORMAT, chunk_shape, write_dist_checkpoint
from toolkit.checkpoint.atomic import atomic_directory, check_output_dir
from toolkit.checkpoint.dcp import DistCheckpointReader, LiveBytes, tracker
from toolkit.checkpoint.hf_config import config_file, copy_side_file, found_side_files, read_hf_config
from toolkit.checkpoint.manifest import write_manifest
from toolkit.checkpoint.safe_load import check_checkpoint, read_dcp_metadata
from toolkit.checkpoint.safetensors_stream import DTYPES, ShardedSafetensorsWriter, parse_size, safetensors_weight_map
from toolkit.errors import UserInputError
from toolkit.families import megatron_fields, megatron_mapping
from toolkit.families.mapping import PADDED_VOCAB, Stacker, stack_counts
from toolkit.readers import read_safetensors_header
from toolkit.spec.engine_settings import megatron_padded_vocab
from toolkit.spec.model import spec_from_hf_dict
from toolkit.spec.moe_rules import smallest_world
from toolkit.spec.plan import resolve_plan

log = logging.getLogger(__name__)
HF_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class MegatronConversion:
    out_dir: Path
    tensors: int
    parameters: int
    layout: dict
    padded_vocab: int


MOE_EXPERTS_KEY = ".mlp.experts.experts."  # Megatron-Core's sharded key prefix of the experts' weights


def layout_world(tp: int, pp: int, ep: int, etp: int | None = None) -> int:
    """The fewest ranks of a layout (the plan's rule, spec/moe_rules.smallest_world; no context parallelism here)."""
    return smallest_world(tp, 1, pp, ep, etp or tp)


def check_layout(hf_config: dict, tp: int, pp: int, vpp: int, ep: int, etp: int | None = None) -> None:
    """The layout rules of `toolkit.spec.plan` (heads and kv groups by TP, layers by PP x VPP, experts by EP and
    ETP) on the fewest ranks the layout takes."""
    model = spec_from_hf_dict(hf_config, hf_config.get("model_type", "model"))
    world = layout_world(tp, pp, ep, etp)
    # MoE training at TP > 1 needs sequence parallelism, and that Transformer Engine's norms (spec/plan.py); a
    # checkpoint is meant for such a run, and a forward pass (`check`) needs neither: the layout is checked as that
    # run's plan
    training_rules = {"sequence_parallel": True, "transformer_impl": "transformer_engine"} \
        if model.is_moe and tp > 1 else {}
    resolve_plan(model, world, backend="megatron", gpus_per_node=world, tp=tp, pp=pp, vpp=vpp, ep=ep,
                 **({"etp": etp} if etp is not None else {}), **training_rules,
                 micro_batch=1, seq_len=min(128, model.max_position_embeddings or 128))


def megatron_model_config(hf_config: dict, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
                          padded_vocab: int | None = None, etp: int | None = None) -> dict:
    """The megatron.yaml sections a GPTModel of this HF config needs (fp32, CPU initialisation, local layer spec);
    `etp`: the expert layers' tensor-parallel size under parallel folding (None: --tp's)."""
    sections = megatron_fields(hf_config)
    vocab = sections["model"]["vocab_size"]
    return {
        "schedule": {"seed": 0},
        "model": {"family": hf_config["model_type"], "vocab_size": vocab},
        "transformer_config": {**sections["transformer_config"], "tensor_model_parallel_size": tp,
                               "pipeline_model_parallel_size": pp,
                               "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None,
                               "context_parallel_size": 1, "expert_model_parallel_size": ep,
                               "use_cpu_initialization": True, "transformer_impl": "local",
                               **({"expert_tensor_parallel_size": etp} if etp is not None else {}),
                               **({"moe_token_dispatcher_type": "alltoall"} if ep > 1 else {})},
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
def megatron_model(config: dict, device: str | None = None):
    """A GPTModel (one chunk, this rank's part at the config's layout) inside Megatron-Core's process groups; built
    under `torch.device(device)` when given ("meta": shapes only)."""
    import torch

    with device_context():
        initialize_parallel(config)
        try:
            with torch.device(device) if device else contextlib.nullcontext():
                chunks = build_model_chunks(config, transformer_config(config), to_gpu=device != "meta")
            yield chunks[0] if len(chunks) == 1 else chunks
        finally:
            destroy()


def hf_weight_map(hf_dir: Path) -> dict:
    """Tensor name -> safetensors file of an HF model directory; HF_DIR at fault when it holds no weights."""
    weight_map = safetensors_weight_map(hf_dir, "HF_DIR")
    if weight_map is None:
        raise UserInputError("HF_DIR", f"{hf_dir} has no model.safetensors or model.safetensors.index.json")
    return weight_map


class HFTensors:
    """Read-on-demand access to the tensors of an HF safetensors model (one file or sharded with an index): each
    read maps its file and copies out one tensor; `meta(name)` gives its shape and dtype without reading data."""

    def __init__(self, hf_dir: Path, live: LiveBytes | None = None):
        weight_map = hf_weight_map(hf_dir)
        for file in sorted(set(weight_map.values())):  # every file opens before anything is written
            read_safetensors_header(hf_dir / file, "HF_DIR")
        self.hf_dir, self.weight_map, self.live = hf_dir, weight_map, live

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _open(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise UserInputError("HF_DIR", f"tensor {name} is missing from {self.hf_dir}")
        return safe_open(self.hf_dir / self.weight_map[name], "pt")

    def __getitem__(self, name: str):
        with self._open(name) as handle:
            tensor = handle.get_tensor(name)
        return self.live.track(tensor) if self.live else tensor

    def row(self, name: str, index: int):
        """Row `index` of tensor `name` (one expert of a stacked tensor), reading only that row's bytes."""
        with self._open(name) as handle:
            tensor = handle.get_slice(name)[index:index + 1][0]
        return self.live.track(tensor) if self.live else tensor

    def reader(self):
        """`read(name)` for the weight mappings, with `read.row(name, index)` (mapping.read_row) beside it."""
        def read(name: str):
            return self[name]

        read.row = self.row
        return read

    def meta(self, name: str):
        import torch

        with self._open(name) as handle:
            piece = handle.get_slice(name)
            shape, code = piece.get_shape(), piece.get_dtype()
        dtype = next(getattr(torch, t) for t, (c, _) in DTYPES.items() if c == code)
        return torch.empty(shape, dtype=dtype, device="meta")


@contextlib.contextmanager
def meta_sharded_state_dict(config: dict):
    """`sharded_state_dict()` of the GPTModel of `config` built on the meta device: every weight's checkpoint key,
    global shape and offset, without weight memory."""
    config["transformer_config"]["perform_initialization"] = False
    with megatron_model(config, device="meta") as model:
        sharded = model.sharded_state_dict()
        nested = [k for k, v in sharded.items() if not hasattr(v, "key")]
        if nested:
            raise AssertionError(f"nested entries in GPTModel.sharded_state_dict(): {nested[:3]}")
        yield sharded


def hf_to_megatron(hf_dir: Path, out_dir: Path, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1,
                   progress: bool = False, live: LiveBytes | None = None, etp: int | None = None) -> MegatronConversion:
    """HF safetensors -> a Megatron-Core dist checkpoint that loads at tp/pp/vpp/ep (and other layouts of the same
    vocabulary padding), with config.json beside it and a manifest. Streamed: each Megatron tensor is made from its
    HF tensors when the writer reaches it and dropped after (`live` counts what is held)."""
    import shutil

    hf_config = read_hf_config(hf_dir, "HF_DIR")
    quantized = hf_config.get("quantization_config")
    if quantized:  # DeepSeek-V3's Hub weights are fp8 with per-block scales (weight_scale_inv) beside them
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise UserInputError("HF_DIR", f"{hf_dir} holds quantized weights (quantization_config {method!r}); the "
                                       f"tables map full-precision tensors: convert a bf16 or fp32 copy")
    check_layout(hf_config, tp, pp, vpp, ep, etp)
    check_output_dir(out_dir, inputs=[hf_dir])
    import torch
    from tqdm import tqdm

    padded = megatron_model_config(hf_config, tp=tp)["gpt_model"]["vocab_size"]  # written whole (TP=1), padded for --tp
    config = megatron_model_config(hf_config, padded_vocab=padded)
    source = HFTensors(hf_dir, live)
    items, geometry = megatron_mapping(hf_config.get("model_type")).weight_table(hf_config)
    by_name = {i.megatron: i for i in items if not i.absent_from(source)}
    for name in (n for item in by_name.values() for n in item.hf_names()):
        source.meta(name)  # every HF tensor present before anything is written
    with atomic_directory(out_dir, inputs=[hf_dir]) as tmp, single_process_group(), \
            meta_sharded_state_dict(config) as sharded:
        targets = {name: entry.data for name, entry in sharded.items() if not name.endswith("_extra_state")}
        unknown, missing = sorted(set(by_name) - set(targets)), sorted(set(targets) - set(by_name))
        if unknown or missing:
            raise AssertionError(f"the {hf_config['model_type']} table does not match GPTModel: "
                                 f"unknown {unknown[:5]}, missing {missing[:5]}")
        parameters = 0
        for name, item in by_name.items():  # shapes checked on meta tensors: no half-written output for a bad one
            shape, want = item.to_megatron(source.meta, geometry).shape, targets[name].shape
            parameters += shape.numel()
            if shape != want and not (name in PADDED_VOCAB and shape[1:] == want[1:] and shape[0] <= want[0]):
                raise UserInputError("HF_DIR", f"{', '.join(item.hf_names())} in {hf_dir} make {name} "
                                               f"{tuple(shape)}; its config.json implies {tuple(want)}")

        read = source.reader()

        def model_tensor(name: str):
            tensor, target = by_name[name].to_megatron(read, geometry), targets[name]
            if tensor.shape != target.shape:  # vocabulary rows: zeros past the end
                tensor = torch.cat([tensor, tensor.new_zeros(target.shape[0] - tensor.shape[0], *target.shape[1:])])
            return tensor.to(target.dtype)

        total = sum(t.numel() * t.element_size() for t in targets.values())
        with tqdm(total=total, unit="B", unit_scale=True, desc="hf-to-megatron", disable=not progress) as bar:
            write_dist_checkpoint(tmp, sharded, model_tensor, bar.update, live)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for side in HF_SIDE_FILES:
            if (hf_dir / side).is_file():
                shutil.copyfile(hf_dir / side, tmp / side)
        layout = {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp or tp, "padded_vocab": padded}
        write_manifest(tmp, step=0, world_size=1, layout=layout, fmt=MANIFEST_FORMAT,
                       extra={"converted_from": str(hf_dir.resolve())})
    log.info("wrote %s (%d tensors, %d parameters)", out_dir, len(by_name), parameters)
    return MegatronConversion(out_dir, len(by_name), parameters, layout, padded)


def checkpoint_vocab(ckpt: Path) -> int:
    """Rows of the embedding in a dist checkpoint (the padded vocabulary it was saved with)."""
    entry = read_dcp_metadata(ckpt, "MEGATRON_DIR").state_dict_metadata.get(PADDED_VOCAB[0])
    if entry is None:
        raise UserInputError("MEGATRON_DIR", f"{ckpt} holds no {PADDED_VOCAB[0]}: not a GPTModel checkpoint")
    return int(entry.size[0])


def load_weights(model, ckpt: Path) -> None:
    """This rank's part of the model from a dist checkpoint, resharded by Megatron-Core to the model's layout (a
    training checkpoint also holds optimizer and scheduler state: only the model's keys are read)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    check_checkpoint(ckpt, "MEGATRON_DIR")  # Megatron-Core's loader unpickles .metadata and stored objects unrestricted
    try:
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt))
    except (CheckpointingException, CheckpointException) as exc:  # torch's wraps each rank's failure
        reason = str(exc).strip().splitlines()[-1].split("Exception: ")[-1]  # torch's carries the rank's traceback
        raise UserInputError("MEGATRON_DIR", f"{ckpt} does not hold this model's weights: {reason[:300]}") from None
    model.load_state_dict(loaded, strict=False)


def describe_entry(entry) -> str:
    """A checkpoint tensor as a user knows it: an expert's weight by its expert and layer (SequentialMLP's
    ShardedTensors are [layer, expert, ...] slices of one tensor per projection)."""
    if MOE_EXPERTS_KEY in entry.key and len(entry.global_offset) > 2:
        layer, expert = entry.global_offset[:2]
        return f"expert {expert} of layer {layer}, {entry.key}"
    return entry.key


def model_tensor(reader: DistCheckpointReader, entry):
    """The whole local tensor a meta ShardedTensor or ShardedTensorFactory of a TP=1 model stands for, read from
    the checkpoint behind `reader`."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(entry, ShardedTensor):
        try:
            return reader.read(entry.key, entry.global_offset, chunk_shape(entry), entry.global_shape).reshape(
                entry.local_shape)
        except UserInputError as exc:  # a damaged file: say which tensor (which expert) it held
            raise UserInputError(exc.key, f"{exc.message} (reading {describe_entry(entry)})") from None
    loaded = dict_list_map_inplace(lambda part: model_tensor(reader, part), entry.build())  # the parts; merged
    return reader.track(entry.merge_fn(loaded))


def megatron_to_hf(ckpt: Path, out_dir: Path, config: Path | None = None, dtype: str = "fp32",
                   progress: bool = False, live: LiveBytes | None = None, max_shard_size: str = "5GB") -> dict:
    """A Megatron-Core dist checkpoint (converted or saved by training, at any layout) -> HF safetensors +
    config.json. Streamed: each model tensor is assembled from its checkpoint chunks, split into its HF tensors,
    written and dropped (`live` counts what is held)."""
    import math

    import torch
    from tqdm import tqdm

    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if out_dtype is None:
        raise UserInputError("--dtype", f"must be fp32 or bf16, got {dtype}")
    max_bytes = parse_size(max_shard_size)
    if not ckpt.is_dir():
        raise UserInputError("MEGATRON_DIR", f"{ckpt} is not a directory")
    metadata = read_dcp_metadata(ckpt, "MEGATRON_DIR")  # a checkpoint first: then its config
    config_path = config or ckpt / "config.json"
    if not config_path.exists():
        raise UserInputError("--config", f"{ckpt} has no config.json beside the checkpoint; pass the model's HF "
                                         f"config.json with --config")
    hf_config = read_hf_config(config_path, "--config" if config else str(config_file(config_path)))
    inputs = [ckpt, config_path]
    check_output_dir(out_dir, inputs=inputs)
    sides = found_side_files([ckpt], ckpt, "MEGATRON_DIR", HF_SIDE_FILES)
    reader = DistCheckpointReader(ckpt, live, metadata=metadata)
    items, geometry = megatron_mapping(hf_config.get("model_type")).weight_table(hf_config)
    config = megatron_model_config(hf_config, padded_vocab=checkpoint_vocab(ckpt))
    with single_process_group(), meta_sharded_state_dict(config) as sharded:
        items = [i for i in items if not (i.optional and i.megatron not in sharded)]
        stacks = stack_counts(items)  # GPT-OSS's experts: one HF tensor of every expert's piece, written whole
        layout = [(name, (stacks[name], *t.shape) if name in stacks else tuple(t.shape), out_dtype)
                  for item in items for name, t in item.to_hf(sharded[item.megatron].data, geometry).items()]
        layout = list({name: (name, shape, dtype) for name, shape, dtype in layout}.values())
        with atomic_directory(out_dir, inputs=inputs) as tmp:
            writer, stacker, track = ShardedSafetensorsWriter(tmp, layout, max_bytes), Stacker(items), tracker(live)
            with tqdm(total=writer.total, unit="B", unit_scale=True, desc="megatron-to-hf", disable=not progress) as bar:
                for item in items:
                    pieces = item.to_hf(model_tensor(reader, sharded[item.megatron]), geometry)
                    for name in list(pieces):  # popped: each piece is dropped once written (or stacked)
                        whole = stacker.add(name, track(pieces.pop(name).to(out_dtype)))
                        if whole is not None:
                            piece = track(whole[1])
                            bar.update(writer.write(name, piece))
                            del piece, whole
            writer.close()
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
            for side, path in sides.items():
                copy_side_file(path, tmp / side, ckpt, "MEGATRON_DIR")
    return {"out_dir": str(out_dir), "tensors": len(layout), "parameters": sum(math.prod(s) for _, s, _ in layout),
            "shards": len(writer.shards)}
