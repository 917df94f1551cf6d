"""The training recipe (YAML): model, data, cluster, hyper-parameters, and an explicit plan or `plan: auto`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from toolkit.data.sidecar import megatron_prefix
from toolkit.data.split import split_shares
from toolkit.errors import UserInputError, named_as
from toolkit.numeric import FINITE, SEED_MAX, WEIGHT_MAX, WEIGHT_MIN, Seed
from toolkit.outputs import word_problem
from toolkit.readers import read_json, read_yaml
from toolkit.spec.calibration import load_calibration
from toolkit.spec.cluster import DEFAULT_GPU, get_gpu, load_catalogue
from toolkit.spec.finetune import FinetuneOptions, finetune_field, finetune_key
from toolkit.spec.model import PRESET_DIR, load_model_spec, spec_from_hf_dict
from toolkit.spec.options import PlanOptions, ScaleOut, default, default_text, option_name, recipe_key


class _Strict(BaseModel):
    # strict: `micro_batch: true` or `max_steps: "30"` is a mistake in a YAML file, not a 1 or a 30
    model_config = ConfigDict(extra="forbid", strict=True, **FINITE)


class ModelSection(_Strict):
    source: str | None = Field(None, description="Preset name, HF config.json or its directory, hub id, or toolkit spec.")
    config: dict | None = Field(None, description="An HF config.json inline (pre-training from random init).")
    pretrained: str | None = Field(None, description="Directory or hub id with weights to start from; omit to train "
                                                     "from random init.")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if (self.source is None) == (self.config is None):
            raise ValueError("set exactly one of model.source and model.config")
        return self


class TokenizerSection(_Strict):
    path: str | None = Field(None, description="Tokenizer directory or hub id; omit to train a byte-level BPE locally.")
    vocab_size: int = Field(512, gt=256, description="Vocabulary of the locally trained byte-level BPE.")


class BlendEntry(_Strict):
    prefix: str = Field(min_length=1, description="A prepared dataset: the --output-prefix of `dmt data prepare` "
                                                  "(its PREFIX.dmt.json names the dataset of data.text_field), or a "
                                                  "Megatron dataset prefix (PREFIX.bin/.idx), relative to the recipe.")
    weight: float = Field(ge=WEIGHT_MIN, le=WEIGHT_MAX, description="Its share of the samples, relative to the "
                                                                    "others' (normalised to sum to 1, as Megatron-LM's "
                                                                    "--data-path weights are).")
    model_config = ConfigDict(extra="forbid", strict=False, **FINITE)  # `weight: 1` is a weight as much as 1.0

    @field_validator("prefix")
    @classmethod
    def _one_word(cls, prefix: str) -> str:
        return _word(prefix)


def _word(text: str) -> str:
    """A path the generated files carry (megatron_args.txt): one word of them (toolkit.outputs.word_problem)."""
    problem = word_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


# data loader worker processes per rank unless data.num_workers says: a blend reads its samples from memory-mapped
# files in the workers; the other sources are tokenised and packed in memory ahead of training, so workers only copy
BLEND_WORKERS, IN_MEMORY_WORKERS = 2, 0


class DataSection(_Strict):
    train_files: list[str] = Field([], description="Local json/jsonl/text/parquet files (relative to the recipe).")
    hub_dataset: str | None = Field(None, description="A datasets hub id instead of local files (needs network).")
    blend: list[BlendEntry] = Field([], description="Prepared token datasets (`dmt data prepare`) mixed by weight, "
                                                    "read through Megatron-Core's BlendedMegatronDatasetBuilder and "
                                                    "GPTDataset by every backend; needs data.tokenizer.path (the "
                                                    "tokenizer they were prepared with).")
    split: str = Field("969,30,1", description="A blend's train,valid,test shares of each dataset's documents "
                                               "(Megatron-LM's --split).")
    cache_dir: str | None = Field(None, description="Where GPTDataset keeps a blend's index cache (relative to the "
                                                    "recipe); default: OUTPUT/data_cache. Built once, by rank 0.")
    num_workers: int | None = Field(None, ge=0, description=f"Data loader worker processes per rank; default "
                                                            f"{BLEND_WORKERS} with a blend, {IN_MEMORY_WORKERS} "
                                                            f"otherwise (those rows are packed in memory).")
    pin_memory: bool = Field(True, description="Pinned host memory for the batches (the data loader's pin_memory; "
                                               "nothing to pin on CPU ranks).")
    reset_position_ids: bool = Field(False, description="A blend's position ids restart at each end-of-document "
                                                        "token (GPTDataset's option).")
    reset_attention_mask: bool = Field(False, description="A blend's attention does not cross an end-of-document "
                                                          "token (GPTDataset's option; see docs/data.md, 'Blends', "
                                                          "for where this is exact).")
    eod_mask_loss: bool = Field(False, description="No loss on a blend's end-of-document tokens (GPTDataset's "
                                                   "option).")
    format: Literal["text", "chat", "prompt_completion"] = Field(
        "text", description="text: plain text, every token trained, packed into blocks; chat: `messages` lists "
                            "(role/content) rendered with the chat template, loss on the assistant tokens only; "
                            "prompt_completion: two fields, loss on the completion only.")
    text_field: str = Field("text", description="Column holding the text in json/jsonl/parquet files.")
    messages_field: str = Field("messages", description="chat: column holding the list of {role, content} messages.")
    prompt_field: str = Field("prompt", description="prompt_completion: column holding the prompt.")
    completion_field: str = Field("completion", description="prompt_completion: column holding the completion.")
    chat_template: str | None = Field(None, description="chat: a Jinja chat template file (relative to the recipe) "
                                                        "with {% generation %} markers around what the assistant "
                                                        "says; default: the tokenizer's own (TRL's training variant "
                                                        "where it has one), else ChatML.")
    packing: bool = Field(True, description="chat / prompt_completion: pack several examples per sequence (position "
                                            "ids restart per example, so neither attention nor the loss crosses an "
                                            "example boundary); false: one example per sequence, padded.")
    eval_fraction: float = Field(0.05, ge=0, lt=0.5, description="Share of packed sequences held out for eval.")
    tokenizer: TokenizerSection = Field(TokenizerSection(), description="Which tokenizer, or how to train one.")

    @field_validator("split")
    @classmethod
    def _split(cls, split: str) -> str:
        split_shares(split)
        return split

    @field_validator("cache_dir")
    @classmethod
    def _cache_word(cls, cache_dir: str | None) -> str | None:
        return cache_dir if cache_dir is None else _word(cache_dir)

    @model_validator(mode="after")
    def _one_source(self) -> "DataSection":
        if [bool(self.train_files), bool(self.hub_dataset), bool(self.blend)].count(True) != 1:
            raise ValueError("set exactly one of data.train_files, data.hub_dataset and data.blend")
        if self.blend and self.format != "text":
            raise ValueError("data.blend holds prepared text tokens: format must be text")
        if self.blend and not self.tokenizer.path:
            raise ValueError("data.blend needs data.tokenizer.path: the tokenizer its prefixes were prepared with")
        if self.chat_template is not None and self.format != "chat":
            raise ValueError("data.chat_template applies to format: chat")
        return self


class K8sSection(_Strict):
    """Kubernetes: what `dmt generate` and `dmt k8s render` put in the manifests (the flags of `dmt k8s render`
    override them)."""

    image: str | None = Field(None, description="Container image holding the toolkit and this project at /workspace; "
                                                "when set, `dmt generate` also writes k8s-trainjob.yaml.")


class ClusterSection(_Strict):
    gpus: int = Field(gt=0, description="Total GPUs (CPU processes on a machine without GPUs).")
    gpus_per_node: int = Field(default("gpus_per_node"), gt=0, description="GPUs (processes) per node (default: the "
                                                                         "GPU's in the catalogue, 4 on GB200/GB300, "
                                                                         "else 8).")
    nvlink_domain: int | None = Field(None, gt=0, description="GPUs on one NVLink/NVSwitch fabric, whole nodes "
                                                              "(default: the GPU's, 72 on GB200/GB300 NVL72, else "
                                                              "the node).")
    network: ScaleOut = Field(default("network"), description="The scale-out network between NVLink domains: "
                                                              "infiniband, roce or ethernet (toolkit/estimate/comm.py "
                                                              "holds each one's bandwidth, efficiency and latency).")
    gpu: str = Field(DEFAULT_GPU, description="GPU from the catalogue, for the memory estimate and the planner.")
    nodes: int | None = Field(None, gt=0, description="Defaults to gpus / gpus_per_node, at least 1.")
    accelerator: Literal["gpu", "cpu"] = Field("gpu", description="cpu: gloo processes, as the tests and demo run.")
    host_memory_gb: float | None = Field(None, gt=0, description="RAM of one node in GiB: a plan whose offload (ZeRO, "
                                                                 "CPUOffloadPolicy, activations) needs more does not fit.")
    calibration: str | None = Field(None, description="A calibration file `dmt calibrate` wrote for cluster.gpu "
                                                      "(relative to the recipe): the plan's predictions use it.")
    k8s: K8sSection = Field(K8sSection(), description="Kubernetes manifests (dmt k8s render, dmt generate).")

    @model_validator(mode="before")
    @classmethod
    def _catalogue_node(cls, data):
        """A GPU whose catalogue node is not 8 GPUs (GB200/GB300 trays of 4) sets gpus_per_node when it is unset."""
        if isinstance(data, dict) and data.get("gpus_per_node") is None and isinstance(data.get("gpu"), str):
            gpu = load_catalogue().get(data["gpu"].lower())
            if gpu is not None and not gpu.host:
                return {**data, "gpus_per_node": gpu.gpus_per_node_default}
        return data

    @field_validator("gpu")
    @classmethod
    def _in_catalogue(cls, name: str) -> str:
        try:
            get_gpu(name)
            return name
        except UserInputError as exc:  # pydantic words it as the key's error: `cluster.gpu: unknown GPU ...`
            raise ValueError(exc.message) from None

    @property
    def num_nodes(self) -> int:
        return self.nodes or max(1, -(-self.gpus // self.gpus_per_node))


class GuardSection(_Strict):
    """The NaN and loss-spike guard: judged on every optimizer step, on the loss of the whole global batch."""

    on_nan: Literal["stop", "skip", "rollback"] = Field(
        "stop", description="What a non-finite loss or gradient norm, or a loss spike, does: stop (save nothing, "
                            "exit code 4, no automatic restart), skip (drop that optimizer step; the learning-rate "
                            "schedule does not advance), rollback (reload the latest verified checkpoint and go on "
                            "with the data after the offending step: the steps since the checkpoint are dropped).")
    spike_factor: float = Field(0.0, ge=0, description="A loss above this many times the median of the last `window` "
                                                       "steps is a spike (e.g. 3); 0: no spike rule.")
    window: int = Field(50, gt=0, description="Steps in the running median of the spike rule; the rule judges once "
                                              "that many steps are known.")

    @field_validator("spike_factor")
    @classmethod
    def _above_one(cls, factor: float) -> float:
        if 0 < factor <= 1:
            raise ValueError(f"must be 0 (off) or above 1 (3 = three times the median), got {factor}")
        return factor


class ProfileSection(_Strict):
    """torch.profiler on chosen steps and ranks (toolkit/runtime/profile.py): each rank's trace in RUN_DIR/profile/
    (Chrome/Perfetto JSON that TensorBoard's profiler and Holistic Trace Analysis open) and the measured breakdown
    `dmt report --breakdown` sets beside the prediction. Off unless set (toolkit/train.py --profile-steps A-B)."""

    start_step: int = Field(gt=0, description="The first optimizer step recorded (1-based, as metrics.jsonl counts).")
    steps: int = Field(2, gt=0, description="Consecutive steps recorded from start_step on.")
    ranks: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="Ranks that record (e.g. [0, 1]); "
                                                                              "default: every rank.")
    memory: bool = Field(False, description="Also record allocations: each recording CPU rank writes torch's "
                                            "memory timeline (profile/rank<R>.memory.html and its events, "
                                            "profile/memory/rank<R>.json), each GPU rank its allocator snapshot "
                                            "(profile/rank<R>.memory.pickle, pytorch.org/memory_viz); slower.")

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


class TrainingSection(_Strict):
    seq_len: int = Field(gt=0, description="Tokens per packed training sequence.")
    global_batch: int = Field(gt=0, description="Sequences per optimizer step.")
    max_steps: int = Field(gt=0, description="Optimizer steps to train (the schedule's length).")
    learning_rate: float = Field(gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate of the cosine schedule, as a share "
                                                             "of the peak.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after the warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to the peak learning rate.")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="How learning_rate and warmup_steps follow the global batch when it differs from "
                            "lr_reference_batch: linear or sqrt in the batch for the rate, inversely for the warm-up "
                            "steps (the same samples); dmt generate writes the scaled numbers (toolkit/spec/"
                            "lr_scaling.py).")
    lr_reference_batch: int | None = Field(None, gt=0, description="The global batch (sequences) learning_rate and "
                                                                   "warmup_steps were tuned at; required by "
                                                                   "lr_scaling linear or sqrt.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled (AdamW) weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1 (SGD momentum).")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: no clipping).")
    seed: Seed = Field(42, description=f"Seed of the model init and the data order (0 to {SEED_MAX}, what numpy's "
                                       f"seed, which HF's set_seed calls, accepts).")
    logging_steps: int = Field(1, gt=0, description="Write a metrics.jsonl record every N steps.")
    save_steps: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        0, description="Checkpoint every N steps (0: only at the end); auto: Daly's optimum interval for the planned "
                       "step time, the checkpoint's cost and the expected failures (toolkit/planner/save_interval.py), "
                       "written by `dmt generate` into the generated files and recorded in plan.json.")
    async_save: bool | None = Field(None, description="Write each checkpoint in the background while training goes "
                                                      "on (Megatron-Core: dist_checkpointing's asynchronous save on its "
                                                      "persistent writer process); its manifest and `latest` follow "
                                                      "once every rank's files are complete. Unset: on where the "
                                                      "backend saves asynchronously (Megatron-Core) on GPUs; on CPU "
                                                      "ranks when true; DeepSpeed and FSDP2 save synchronously today, "
                                                      "and say so.")
    eval_steps: int = Field(0, ge=0, description="Evaluate on the held-out split every N steps (0: never).")
    report_to: list[Literal["wandb", "tensorboard", "none"]] = Field(
        ["none"], description="Loggers besides metrics.jsonl; wandb runs offline when no API key is configured.")
    hang_timeout_s: float = Field(600.0, ge=0, description="A rank whose heartbeat stops, or a step or collective "
                                                           "that no rank leaves, for this long is named in "
                                                           "OUTPUT/incident.json with the Python stacks, and every "
                                                           "rank exits (code 3) for the launcher to restart the job. "
                                                           "Longer than the slowest step and checkpoint save; 0: no "
                                                           "watchdog.")
    max_restarts: int = Field(3, ge=0, description="Restarts of a failed job from the latest verified checkpoint by "
                                                   "launch.sh and slurm.sbatch (torchrun's --max-restarts; a retry "
                                                   "loop for the deepspeed and accelerate launchers); 0: none.")
    restart: Literal["relaunch", "in_process"] = Field(
        "relaunch", description="How a failed job continues from the latest verified checkpoint. relaunch: every rank "
                                "is ended and the launcher starts them all again (training.max_restarts times). "
                                "in_process: NVIDIA Resiliency Extension's in-process restart (Megatron-Core "
                                "and FSDP2 backends): the training function restarts inside the surviving processes, "
                                "a hot spare (training.spare_ranks) replacing a rank that died or hung; launch.sh's "
                                "`inprocess` launcher (docs/faults.md).")
    spare_ranks: int = Field(1, ge=0, description="training.restart: in_process: processes launched beyond "
                                                  "cluster.gpus that wait as hot spares and take the place of a "
                                                  "rank lost during training (one loss each).")
    guard: GuardSection = Field(GuardSection(), description="What a non-finite loss or gradient norm, or a loss "
                                                            "spike, does to the run.")
    profile: ProfileSection | None = Field(None, description="Record steps with torch.profiler (unset: off, no "
                                                             "cost): traces and the measured breakdown in "
                                                             "RUN_DIR/profile/.")

    @model_validator(mode="after")
    def _lr_reference(self) -> "TrainingSection":
        if self.lr_scaling != "none" and self.lr_reference_batch is None:
            raise ValueError(f"lr_scaling {self.lr_scaling} needs training.lr_reference_batch, the global batch "
                             f"learning_rate was tuned at")
        return self


class _PlanBase(BaseModel):
    """The plan section takes each option's own strictness from PlanOptions (integers strict; a YAML list is a
    tuple of recompute modules)."""

    model_config = ConfigDict(extra="forbid", **FINITE)


def _plan_section() -> type[BaseModel]:
    """The recipe's `plan:` section, derived from PlanOptions: every option a recipe keeps under `plan:`, unset (None)
    by default, so the planner (`auto: true`) or the option's own default fills it."""
    fields: dict = {"auto": (StrictBool, Field(False, description="Let the planner choose every option left unset."))}
    for name, info in PlanOptions.model_fields.items():
        if recipe_key(name) == f"plan.{name}":
            annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            fields[name] = (annotation | None, Field(None, description=f"{info.description} (default: "
                                                                      f"{default_text(name)})"))
    return create_model("PlanSection", __base__=_PlanBase, __doc__=(
        "Options of the parallel plan (toolkit.spec.options.PlanOptions); seq_len and global_batch come from "
        "`training`, gpus_per_node from `cluster`. With `auto: true` the planner picks every option left unset "
        "(`plan: auto` is short for `{auto: true}` over every backend)."), **fields)


PlanSection = _plan_section()


class DeepSpeedSection(_Strict):
    """DeepSpeed-only choices that the parallel plan does not model."""

    zero_plus_plus: bool = Field(False, description="ZeRO++ for ZeRO-3 across nodes: hpZ keeps a secondary parameter "
                                                    "partition inside each node (zero_hpz_partition_size = gpus_per_node) "
                                                    "and weights and gradients travel quantized.")
    auto_values: bool = Field(False, description='Write "auto" for every value HF Trainer fills in (batch sizes, '
                                                 "clipping, precision, optimizer and scheduler numbers) instead of "
                                                 "the explicit numbers.")


RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # it names a directory, a wandb run and a Slurm job


class LocalCheckpointSection(_Strict):
    """Node-local checkpoints through NVIDIA Resiliency Extension's LocalCheckpointManager (docs/faults.md)."""

    dir: str = Field(min_length=1, description="Node-local directory of the local checkpoints (each rank writes "
                                               "DIR/<run name>/<rank>/); relative: to the run's output directory.")
    every: int = Field(1, gt=0, description="A local checkpoint every N steps; the persistent ones stay at "
                                            "training.save_steps, and a resume reads the newer of the two.")
    replication: int = Field(1, ge=1, description="Copies of each rank's local checkpoint, kept by peer ranks on "
                                                  "other nodes (NVRx's CliqueReplicationStrategy); 1: none. NVRx "
                                                  "0.4.1 receives replicas through CUDA buffers: GPUs only.")


class CheckpointSection(_Strict):
    """Checkpoints beside the persistent ones of training.save_steps."""

    local: LocalCheckpointSection | None = Field(None, description="Node-local checkpoints (NVRx), unset: none.")


class Recipe(_Strict):
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
