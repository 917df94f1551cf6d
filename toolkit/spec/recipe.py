"""The training recipe (YAML): model, data, cluster, hyper-parameters, and an explicit plan or `plan: auto`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from toolkit.errors import UserInputError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Strict):
    source: str | None = Field(None, description="Preset, HF config.json or directory, hub id, or toolkit spec.")
    config: dict | None = Field(None, description="An HF config.json inline (pre-training from random init).")
    pretrained: str | None = Field(None, description="Directory or hub id with weights to start from.")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if (self.source is None) == (self.config is None):
            raise ValueError("set exactly one of model.source and model.config")
        return self


class TokenizerSection(_Strict):
    path: str | None = Field(None, description="Tokenizer directory or hub id; omit to train a byte-level BPE locally.")
    vocab_size: int = Field(512, gt=256, description="Vocabulary of the locally trained byte-level BPE.")


class DataSection(_Strict):
    train_files: list[str] = Field(min_length=1, description="Local json/jsonl/text/parquet files (relative to the recipe).")
    hub_dataset: str | None = Field(None, description="A datasets hub id instead of local files (needs network).")
    text_field: str = "text"
    eval_fraction: float = Field(0.05, ge=0, lt=0.5, description="Share of packed sequences held out for eval.")
    tokenizer: TokenizerSection = TokenizerSection()


class ClusterSection(_Strict):
    gpus: int = Field(gt=0, description="Total GPUs (CPU processes on a machine without GPUs).")
    gpus_per_node: int = Field(8, gt=0)
    gpu: str = Field("h100-80gb", description="GPU from the catalogue, for the memory estimate and the planner.")
    nodes: int | None = Field(None, gt=0, description="Defaults to gpus / gpus_per_node, at least 1.")
    accelerator: Literal["gpu", "cpu"] = Field("gpu", description="cpu: gloo processes, as the tests and demo run.")

    @property
    def num_nodes(self) -> int:
        return self.nodes or max(1, -(-self.gpus // self.gpus_per_node))


class TrainingSection(_Strict):
    seq_len: int = Field(gt=0)
    global_batch: int = Field(gt=0, description="Sequences per optimizer step.")
    max_steps: int = Field(gt=0)
    learning_rate: float = Field(gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = Field(1.0, ge=0)
    seed: int = 42
    logging_steps: int = Field(1, gt=0)
    save_steps: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    eval_steps: int = Field(0, ge=0)
    report_to: list[Literal["wandb", "tensorboard", "none"]] = ["none"]


class PlanSection(_Strict):
    """Options of toolkit.spec.plan.resolve_plan; seq_len and global_batch come from `training`.

    With `auto: true` the planner picks every option left unset (`plan: auto` is short for `{auto: true}` over
    both backends)."""

    auto: bool = False
    backend: Literal["deepspeed", "megatron"] | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    micro_batch: int | None = None
    recompute: Literal["none", "selective", "full"] | None = None
    precision: Literal["bf16", "fp16", "fp32", "fp8"] | None = None
    attention: Literal["sdpa", "eager"] | None = None
    optimizer: Literal["adamw", "adamw8bit", "sgd"] | None = None
    offload_optimizer: Literal["none", "cpu", "nvme"] | None = None
    offload_params: Literal["none", "cpu", "nvme"] | None = None
    nvme_path: str | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


class Recipe(_Strict):
    name: str
    model: ModelSection
    data: DataSection
    cluster: ClusterSection
    training: TrainingSection
    plan: PlanSection | Literal["auto"] = PlanSection()
    base_dir: str = Field(".", description="Set by the loader: the recipe's directory, for relative paths.")

    def path(self, relative: str) -> Path:
        """A path from the recipe, relative to the recipe file unless absolute."""
        candidate = Path(relative)
        return candidate if candidate.is_absolute() else Path(self.base_dir) / candidate


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe; every problem is one UserInputError naming the dotted key."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserInputError("--recipe", f"cannot read {path} ({exc})") from None
    if not isinstance(data, dict):
        raise UserInputError(str(path), "expected a mapping at the top level")
    data.setdefault("base_dir", str(path.resolve().parent))
    try:
        return Recipe(**data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(part) for part in err["loc"])
        raise UserInputError(f"{path.name}: {key}", err["msg"]) from None


def recipe_model(recipe: Recipe):
    """The recipe's ModelSpec (model.source read like --model, or the inline HF config)."""
    from toolkit.spec.model import load_model_spec, spec_from_hf_dict

    if recipe.model.config is not None:
        return spec_from_hf_dict(recipe.model.config, name=recipe.name)
    source = recipe.model.source
    local = recipe.path(source)
    return load_model_spec(str(local) if local.exists() else source)


def recipe_plan(recipe: Recipe, model, **overrides):
    """The resolved Plan: the recipe's explicit plan (with command-line overrides), or the planner's choice."""
    from toolkit.spec.plan import resolve_plan

    fixed = dict(seq_len=recipe.training.seq_len, global_batch=recipe.training.global_batch,
                 gpus_per_node=recipe.cluster.gpus_per_node)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    section = PlanSection(auto=True) if recipe.plan == "auto" else recipe.plan
    options = {k: v for k, v in section.model_dump(exclude={"auto"}).items() if v is not None and v is not False}
    options.update(overrides)
    if section.auto:
        from toolkit.planner.search import best_plan
        from toolkit.spec.cluster import get_gpu

        return best_plan(model, recipe.cluster.gpus, get_gpu(recipe.cluster.gpu), **fixed, **options)
    return resolve_plan(model, recipe.cluster.gpus, **fixed, **options)
