"""The training recipe (YAML): the top-level Recipe over its sections (recipe_data, recipe_cluster, recipe_training),
its loading with errors that name the dotted key, and what is read from a recipe across its sections."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, field_validator

from toolkit.data.sidecar import megatron_prefix
from toolkit.errors import UserInputError, named_as
from toolkit.readers import read_json, read_yaml
from toolkit.spec.calibration import load_calibration
from toolkit.spec.finetune import FinetuneOptions, finetune_field, finetune_key
from toolkit.spec.model import PRESET_DIR, load_model_spec, spec_from_hf_dict
from toolkit.spec.options import option_name, recipe_key
from toolkit.spec.recipe_cluster import ClusterSection, PlanSection
from toolkit.spec.recipe_data import BLEND_WORKERS, IN_MEMORY_WORKERS, DataSection, ModelSection, Section
from toolkit.spec.recipe_training import CheckpointSection, DeepSpeedSection, TrainingSection

RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # it names a directory, a wandb run and a Slurm job


class Recipe(Section):
    name: str = Field(pattern=RUN_NAME, description="Run name (output directory, wandb run name, Slurm job name): "
                                                    "letters, digits, '.', '_' and '-', at most 100.")
    model: ModelSection = Field(description="What to train.")
    data: DataSection = Field(description="What to train on.")
    cluster: ClusterSection = Field(description="Where to train.")
    training: TrainingSection = Field(description="Hyper-parameters, schedule, logging and checkpointing.")
    plan: PlanSection = Field(PlanSection(), description="Parallel plan options, or `auto` for the planner's choice.")
    deepspeed: DeepSpeedSection = Field(DeepSpeedSection(), description="DeepSpeed-only options.")
    checkpoint: CheckpointSection = Field(CheckpointSection(), description="Local checkpoints beside the persistent "
                                                                           "ones.")
    finetune: FinetuneOptions = Field(FinetuneOptions(), description="What trains: every parameter, or LoRA / QLoRA "
                                                                     "adapters on a frozen base (PEFT).")
    base_dir: str = Field(".", description="Set by the loader: the recipe's directory, for relative paths.")

    @field_validator("plan", mode="before")
    @classmethod
    def _plan_auto(cls, value):
        return {"auto": True} if value == "auto" else value

    def path(self, relative: str) -> Path:
        """A path from the recipe, relative to the recipe file unless absolute."""
        candidate = Path(relative)
        return candidate if candidate.is_absolute() else Path(self.base_dir) / candidate

    def locate(self, name: str) -> str:
        """A model or tokenizer reference: the local path (relative to the recipe) when it exists, else a hub id."""
        local = self.path(name)
        return str(local) if local.exists() else name


def _fix_hint(err: dict) -> str:
    """The pydantic message, plus what to do for the common mistakes."""
    if err["type"] == "extra_forbidden":
        section: type[BaseModel] = Recipe
        for part in err["loc"][:-1]:
            annotation = section.model_fields[part].annotation if part in section.model_fields else None
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return "unknown key; remove it"
            section = annotation
        return f"unknown key; valid keys here: {', '.join(section.model_fields)}"
    if err["type"] == "literal_error":
        return f"got {err['input']!r}; valid: {err['ctx']['expected']}"
    if err["type"] == "finite_number":
        return f"must be a finite number, got {err['input']!r}"
    if err["type"] == "value_error":
        return err["msg"].removeprefix("Value error, ")
    if err["type"] in ("int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type"):
        expected = err["type"].removesuffix("_type").replace("int", "an integer").replace("float", "a number") \
            .replace("bool", "true or false").replace("string", "a string").replace("list", "a list") \
            .replace("dict", "a mapping")
        return f"must be {expected}, got {err['input']!r}"
    if err["type"] == "string_pattern_mismatch" and err["loc"] == ("name",):
        return (f"{err['input']!r}: use letters, digits, '.', '_' and '-' only (no spaces or '/'), at most 100 "
                f"characters, starting with a letter or digit; it names the run directory, the wandb run and the "
                f"Slurm job")
    return err["msg"]


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe; the first problem becomes a UserInputError naming the dotted key."""
    path = Path(path)
    data = read_yaml(path, "--recipe", what="a recipe (a YAML mapping: name, model, data, cluster, training, plan)")
    data.setdefault("base_dir", str(path.resolve().parent))
    try:
        return Recipe(**data)
    except ValidationError as exc:
        # a number's union (an int or a finite float) fails in both branches: the finite rule is the one to report;
        # then a misspelt key (`trainig:`), which explains the 'Field required' of the key it was meant to be
        order = {"finite_number": 0, "extra_forbidden": 1}
        errors = sorted(exc.errors(), key=lambda err: order.get(err["type"], 2))
        key = ".".join(str(part) for part in errors[0]["loc"] if part not in ("int", "float")) or "recipe"
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise UserInputError(f"{path.name}: {key}", _fix_hint(errors[0]) + more) from None


def recipe_files(recipe: Recipe) -> list[Path]:
    """The files and directories on this machine that a recipe names (model, weights, data, chat template,
    tokenizer, calibration): inputs of every command that reads the recipe, which none of its outputs may replace."""
    named = [recipe.model.source, recipe.model.pretrained, *recipe.data.train_files, recipe.data.chat_template,
             recipe.data.tokenizer.path, recipe.cluster.calibration]
    named += [f"{prefix}{suffix}" for entry in recipe.data.blend  # a prefix's sidecar, or its datasets' pair
              for prefix in (entry.prefix, megatron_prefix(entry.prefix, recipe.data.text_field))
              for suffix in (".dmt.json", ".bin", ".idx")]
    return [recipe.path(name) for name in named if name and _exists(recipe.path(name))]


def data_workers(recipe: Recipe) -> int:
    """Data loader worker processes per rank: data.num_workers, else the default of the recipe's data source."""
    if recipe.data.num_workers is not None:
        return recipe.data.num_workers
    return BLEND_WORKERS if recipe.data.blend else IN_MEMORY_WORKERS


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL: no file here
        return False


def recipe_model(recipe: Recipe):
    """The recipe's ModelSpec (model.source read like --model, or the inline HF config)."""
    if recipe.model.config is not None:
        return spec_from_hf_dict(recipe.model.config, name=recipe.name)
    return load_model_spec(recipe.locate(recipe.model.source))


def recipe_calibration(recipe: Recipe, override: str | Path | None = None):
    """The calibration a recipe's predictions use: `override` (a --calibration flag), else cluster.calibration; checked
    to be one of cluster.gpu. None without either."""
    if override is None and recipe.cluster.calibration is None:
        return None
    key = "--calibration" if override is not None else "cluster.calibration"
    path = Path(override) if override is not None else recipe.path(recipe.cluster.calibration)
    calibration = load_calibration(path, key)
    calibration.check_hardware(recipe.cluster.gpu, key)
    return calibration


def megatron_layers(recipe: Recipe) -> str | None:
    """Megatron-Core's layer modules for this recipe: its own choice, else `local` on CPU (Transformer Engine needs a
    GPU); None lets the plan take its default (Transformer Engine's)."""
    return recipe.plan.transformer_impl or ("local" if recipe.cluster.accelerator == "cpu" else None)


# flags of shared code whose value a recipe keeps outside its plan section
_CLUSTER_FLAGS = {"--gpus": "cluster.gpus", "--gpu": "cluster.gpu"}


def recipe_key_of(flag: str, overrides=()) -> str | None:
    """The recipe key a shared flag names (--zero -> plan.zero, --seq-len -> training.seq_len, --gpu -> cluster.gpu);
    None for a flag given on the command line (in `overrides`), which keeps its name."""
    if flag in _CLUSTER_FLAGS:
        return _CLUSTER_FLAGS[flag]
    if (field := finetune_field(flag)) is not None:
        given = (overrides.get("finetune") or {}) if isinstance(overrides, dict) else {}
        return None if field in given else finetune_key(field)
    name = option_name(flag)
    return None if name is None or name in overrides else recipe_key(name)


def recipe_names(overrides=()) -> named_as:
    """`with recipe_names(overrides):` problems found while working from a recipe name its keys."""
    return named_as(lambda key: recipe_key_of(key, overrides))


def recipe_hf_config(recipe: Recipe) -> dict:
    """The HF config dict to instantiate: the recipe's inline config, or the config file behind model.source."""
    if recipe.model.config is not None:
        return dict(recipe.model.config)

    source = recipe.model.source
    for candidate in (recipe.path(source), recipe.path(source) / "config.json", PRESET_DIR / f"{source}.json"):
        if candidate.is_file():
            data = read_json(candidate, "model.source", what="an HF config.json")
            return {k: v for k, v in data.items() if not k.startswith("_dmt")}
    if "/" in source and not recipe.path(source).exists():  # a hub id: its config.json (the local cache offline)
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(source).to_dict()
        except (OSError, ValueError) as exc:
            raise UserInputError("model.source", f"could not load the hub config of '{source}': "
                                                 f"{str(exc).splitlines()[0]}") from None
    raise UserInputError("model.source", f"{source}: pre-training needs a config.json (preset, file, directory or "
                                         f"hub id)")


def recipe_at_world_size(recipe: Recipe, gpus: int) -> Recipe:
    """The recipe launched on `gpus` processes instead of cluster.gpus (train.py --gpus: a resume at another world
    size), as many per node as fit."""
    cluster = {"gpus": gpus, "gpus_per_node": min(gpus, recipe.cluster.gpus_per_node)}
    return recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update=cluster)})


def recipe_vocab_size(recipe: Recipe) -> int:
    """The vocabulary of the recipe's model: its config's (the weights' own config for a pretrained model)."""
    if recipe.model.pretrained:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(recipe.locate(recipe.model.pretrained)).vocab_size
    return recipe_hf_config(recipe)["vocab_size"]
