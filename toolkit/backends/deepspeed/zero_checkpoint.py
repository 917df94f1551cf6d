"""Read DeepSpeed ZeRO 1/2/3 checkpoints lazily: find the tag, check every rank file, yield fp32 tensors one by one.

The layout is DeepSpeed's own (deepspeed/utils/zero_to_fp32.py reconstructs the same tensors): per tag directory,
model-state files with parameter names and shapes, and one `*_optim_states.pt` per data-parallel rank holding that
rank's flat fp32 partition(s). Files are indexed, not loaded (torch_zip.py): only the bytes of the tensor being
built are read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint.torch_zip import index_torch_file
from toolkit.errors import UserInputError
from toolkit.readers import inside, read_text

OPTIM_SUFFIX = "_optim_states.pt"
MODEL_SUFFIX = "_model_states.pt"
MASTER_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups")  # the fp32 master partitions, ZeRO-1/2 and 3


def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def rank_files(tag_dir: Path) -> list[Path]:
    """Every rank's optimizer-state and model-state file of a tag directory, ranks in order."""
    return [*sorted(tag_dir.glob("*" + OPTIM_SUFFIX), key=_natural_key),
            *sorted(tag_dir.glob("*" + MODEL_SUFFIX), key=_natural_key)]


def _load(path: Path):
    return index_torch_file(path, root=path.parent)  # a rank file linked to elsewhere is refused


def _field(value, path: Path, *keys: str):
    """`value[keys[0]][keys[1]]...` of the object indexed from rank file `path`; each missing one a UserInputError."""
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise UserInputError(str(path), f"holds no {key}: not a DeepSpeed ZeRO rank file")
        value = value[key]
    return value


def resolve_tag_dir(path: Path, tag: str | None) -> Path:
    """The directory holding the rank files: PATH/TAG, PATH/<contents of PATH/latest>, or PATH itself."""
    if not path.is_dir():
        raise UserInputError("CKPT_DIR", f"{path} is not a directory")
    if tag is not None:
        tag_dir = path / tag
        if not tag_dir.is_dir():
            tags = sorted(p.name for p in path.iterdir() if p.is_dir() and any(p.glob("*" + OPTIM_SUFFIX)))
            raise UserInputError("--tag", f"no tag '{tag}' in {path}; tags present: {', '.join(tags) or 'none'}")
        return tag_dir
    if (path / "latest").is_file():
        what = "the name of the checkpoint's tag directory"
        tag_dir = inside(path, read_text(path / "latest", what=what).strip(), str(path / "latest"), what)
        if not tag_dir.is_dir():
            raise UserInputError(str(path / "latest"), f"points to {tag_dir.name}, which does not exist")
        return tag_dir
    if any(path.glob("*" + OPTIM_SUFFIX)):
        return path
    raise UserInputError("CKPT_DIR", f"{path} holds no DeepSpeed checkpoint (no 'latest' file, no *{OPTIM_SUFFIX}); pass --tag")


@dataclass
class ZeroCheckpoint:
    tag_dir: Path
    stage: int
    world_size: int
    param_shapes: dict  # trainable parameter name -> torch.Size, in flat-buffer order, per group
    group_param_names: list[list[str]]
    alignment_paddings: list[list[int]] | None
    shared: dict[str, str]  # alias -> name it shares storage with
    buffers: dict = field(default_factory=dict)
    frozen_shapes: dict = field(default_factory=dict)
    _model_states: list[dict] = field(default_factory=list, repr=False)
    _flat_groups: list[list] = field(default_factory=list, repr=False)  # [rank][group] -> LazyTensor of fp32 values

    @property
    def names(self) -> list[str]:
        """Every tensor the checkpoint reconstructs: buffers, frozen parameters, trainable parameters."""
        return list(self.buffers) + list(self.frozen_shapes) + list(self.param_shapes)

    def shape(self, name: str):
        if name in self.buffers:
            return self.buffers[name].shape
        return self.frozen_shapes.get(name) or self.param_shapes[name]

    def tensors(self) -> Iterator[tuple[str, object]]:
        """(name, fp32 tensor) for every name, building one parameter at a time."""
        import torch

        for name, source in self.sources():
            if isinstance(source, list):
                pieces = [lazy.read(start, count) for lazy, start, count in source]
                source = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).view(self.shape(name))
            yield name, source

    def sources(self) -> Iterator[tuple[str, object]]:
        """(name, tensor) for buffers and frozen parameters; (name, pieces) for trainable fp32 parameters.

        pieces = [(LazyTensor, first element, element count), ...]: contiguous runs of rank partitions that,
        concatenated, are the parameter. A converter may copy them byte for byte without reading them.
        """
        for name, lazy in self.buffers.items():
            tensor = lazy.load()
            yield name, tensor.float() if tensor.is_floating_point() else tensor
        yield from self._frozen()
        yield from self._zero12_pieces() if self.stage <= 2 else self._zero3_pieces()

    def _zero12_pieces(self) -> Iterator[tuple[str, list]]:
        for group, names in enumerate(self.group_param_names):
            parts = [self._flat_groups[rank][group] for rank in range(self.world_size)]
            part = parts[0].numel()
            offset = 0
            for index, name in enumerate(names):
                numel = math.prod(self.param_shapes[name])
                pieces, start, end = [], offset, offset + numel
                while start < end:  # the flat fp32 vector is the ranks' partitions end to end
                    rank, within = divmod(start, part)
                    take = min(end - start, part - within)
                    pieces.append((parts[rank], within, take))
                    start += take
                yield name, pieces
                offset += numel
                if self.alignment_paddings is not None:
                    offset += self.alignment_paddings[group][index]

    def _zero3_pieces(self) -> Iterator[tuple[str, list]]:
        sizes = [t.numel() for t in self._flat_groups[0]]
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        offset = 0
        for name, shape in self.param_shapes.items():
            numel = math.prod(shape)
            partitioned = math.ceil(numel / self.world_size)  # each rank holds one padded slice of every parameter
            pieces, remaining = [], numel
            for rank in range(self.world_size):
                start, end = offset, offset + partitioned
                for group, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                    if remaining and start < hi and end > lo:
                        first = max(start, lo)
                        count = min(min(end, hi) - first, remaining)
                        pieces.append((self._flat_groups[rank][group], first - lo, count))
                        remaining -= count
            yield name, pieces
            offset += partitioned

    def _frozen(self) -> Iterator[tuple[str, object]]:
        for name, shape in self.frozen_shapes.items():
            import torch

            if self.stage <= 2:  # the 16-bit module copy is the only one (as zero_to_fp32)
                yield name, self._model_states[0]["module"][name].load().float()
            else:
                fragments = [state["frozen_param_fragments"][name].load() for state in self._model_states]
                yield name, torch.cat(fragments)[: math.prod(shape)].view(shape).float()


def open_zero_checkpoint(path: Path, tag: str | None = None) -> ZeroCheckpoint:
    """Index a ZeRO checkpoint; raises UserInputError naming the file for missing or damaged rank files."""
    tag_dir = resolve_tag_dir(path, tag)
    optim_files = sorted(tag_dir.glob("*" + OPTIM_SUFFIX), key=_natural_key)
    model_files = sorted(tag_dir.glob("*" + MODEL_SUFFIX), key=_natural_key)
    if not optim_files or not model_files:
        raise UserInputError(str(tag_dir), f"no *{OPTIM_SUFFIX} or *{MODEL_SUFFIX} files: not a ZeRO checkpoint")
    first = _field(_load(optim_files[0]), optim_files[0], "optimizer_state_dict")
    stage = int(_field(first, optim_files[0], "zero_stage"))
    world_size = _field(first, optim_files[0], "partition_count")
    world_size = max(world_size) if isinstance(world_size, list) else int(world_size)
    _check_rank_files(tag_dir, optim_files, world_size, "optimizer")
    if stage == 3:
        _check_rank_files(tag_dir, model_files, world_size, "model-state")
    key = MASTER_KEYS[1] if stage == 3 else MASTER_KEYS[0]
    flat_groups = [_field(first, optim_files[0], key)]
    flat_groups += [_field(_load(f), f, "optimizer_state_dict", key) for f in optim_files[1:]]
    model_states = [_load(f) for f in (model_files if stage == 3 else model_files[:1])]
    state = model_states[0]
    _field(state, model_files[0], "param_shapes")
    _field(state, model_files[0], "module")
    param_shapes, groups = {}, []
    for group in state["param_shapes"]:
        groups.append(list(group))
        param_shapes.update(group)
    buffers = {k: v for k, v in state["module"].items() if k in state.get("buffer_names", [])}
    checkpoint = ZeroCheckpoint(
        tag_dir=tag_dir,
        stage=stage,
        world_size=world_size,
        param_shapes=param_shapes,
        group_param_names=groups,
        alignment_paddings=first.get("param_alignment_paddings") if stage <= 2 else None,
        shared=dict(state.get("shared_params") or {}),
        buffers=buffers,
        frozen_shapes=dict(state.get("frozen_param_shapes") or {}),
        _model_states=model_states,
        _flat_groups=flat_groups,
    )
    _check_sizes(checkpoint, optim_files)
    return checkpoint


def _check_rank_files(tag_dir: Path, files: list[Path], world_size: int, kind: str) -> None:
    ranks = {int(m.group(1)) for f in files if (m := re.search(r"rank_(\d+)_", f.name))}
    missing = sorted(set(range(world_size)) - ranks)
    if missing:
        raise UserInputError(
            str(tag_dir), f"{kind} file of rank {missing[0]} is missing ({len(files)} of {world_size} ranks present)"
        )


def _check_sizes(checkpoint: ZeroCheckpoint, optim_files: list[Path]) -> None:
    """Every rank's partitions must be as long as the parameter shapes require (catches mixed or short shards)."""
    for rank, groups in enumerate(checkpoint._flat_groups):
        sizes = [t.numel() for t in groups]
        if sizes != [t.numel() for t in checkpoint._flat_groups[0]]:
            raise UserInputError(str(optim_files[rank]), f"partition sizes {sizes} differ from rank 0's")
    available = sum(t.numel() for t in checkpoint._flat_groups[0]) * checkpoint.world_size
    if checkpoint.stage == 3:
        needed = sum(math.ceil(math.prod(s) / checkpoint.world_size) for s in checkpoint.param_shapes.values())
        needed *= checkpoint.world_size
    else:
        needed = sum(math.prod(s) for s in checkpoint.param_shapes.values())
    if available < needed:
        raise UserInputError(str(optim_files[0]), f"partitions hold {available} values, parameters need {needed}")
