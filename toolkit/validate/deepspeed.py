"""Validate a DeepSpeed JSON the way DeepSpeed will (its own pydantic config classes), plus the rules it only hits at
launch, the memory fit, and its agreement with HF TrainingArguments. Every problem is reported at once, each naming
the key, the conflicting values and the fix.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path

from toolkit.estimate.memory import estimate_memory
from toolkit.spec.plan import resolve_plan
from toolkit.validate import Problem
from toolkit.validate.trainer_args import fill_auto, trainer_problems

__all__ = ["Problem", "validate_deepspeed_config", "memory_problem"]

# Top-level keys DeepSpeed reads only on paths a small config does not take (traced keys below cover the rest)
CONDITIONAL_KEYS = ("sequence_parallel_size",)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _import_deepspeed_quietly() -> None:
    """DeepSpeed's logger writes to the stdout it sees at import; bind it to stderr so --json output stays clean."""
    import contextlib
    import sys

    if "deepspeed" not in sys.modules:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401


@functools.lru_cache(maxsize=1)
def deepspeed_top_level_keys() -> frozenset[str]:
    """Every top-level key the installed DeepSpeed reads: DeepSpeedConfig built on a dict that records each key it
    looks up (DeepSpeed ignores any other key silently, so the list must come from DeepSpeed itself)."""
    _import_deepspeed_quietly()
    from deepspeed.runtime.config import DeepSpeedConfig

    seen: set[str] = set()

    class Recording(dict):
        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):
            return Recording(self)  # `key in config.keys()` is recorded too

    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1))
    return frozenset(seen) | frozenset(CONDITIONAL_KEYS)


def _unknown_keys(config: dict) -> list[Problem]:
    known = deepspeed_top_level_keys()
    problems = []
    for key in config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"rename it to '{close[0]}'" if close else "remove it"
            problems.append(Problem(key, f"is not a key DeepSpeed reads (it ignores it silently); {hint}"))
    return problems


def _batch_values(config: dict) -> list[Problem]:
    problems = []
    for key in BATCH_KEYS:
        value = config.get(key)
        if value is not None and value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(Problem(key, f"{value!r} is not a positive integer; set a positive integer or \"auto\""))
    return problems


def _pydantic_message(err: dict, model) -> str:
    """DeepSpeed's pydantic message, with the rejected value and what to write instead."""
    if err["type"] == "extra_forbidden":
        names = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
        close = difflib.get_close_matches(str(err["loc"][-1]), sorted(names), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "remove it"
        return f"is not an option of DeepSpeed's {model.__name__}; {hint}"
    msg = err["msg"]
    if err["type"] == "enum":  # an enum with aliases lists a value twice ("0, 1, 2, 3 or 3" for the ZeRO stage)
        choices = list(dict.fromkeys(re.split(r", | or ", str(err.get("ctx", {}).get("expected", "")))))
        if len(choices) > 1:
            msg = f"Input should be {', '.join(choices[:-1])} or {choices[-1]}"
    return f"{err['input']!r} is rejected by DeepSpeed's {model.__name__}: {msg}"


def _library_checks(config: dict) -> list[Problem]:
    """DeepSpeed's own config classes: the pydantic models of each section, then DeepSpeedConfig's sanity checks."""
    from pydantic import ValidationError

    _import_deepspeed_quietly()
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    problems = []
    for section, model in (("zero_optimization", DeepSpeedZeroConfig), ("bf16", DeepSpeedBF16Config),
                           ("fp16", DeepSpeedFP16Config)):
        value = config.get(section, {})
        if not isinstance(value, dict):
            problems.append(Problem(section, f"must be a JSON object, got {value!r}"))
            continue
        try:
            model(**value)
        except ValidationError as exc:
            for err in exc.errors():
                key = ".".join([section, *(str(p) for p in err["loc"])])
                problems.append(Problem(key, _pydantic_message(err, model)))
    if problems:
        return problems
    # DeepSpeedConfig asserts batch sizes against the world size it sees (1 here): _batch_rule checks the real one
    single = {k: v for k, v in config.items() if k != "train_batch_size"}
    if config.get("train_batch_size") is not None and "train_micro_batch_size_per_gpu" not in config:
        single["train_micro_batch_size_per_gpu"] = 1  # DeepSpeed derives it from the world size; _batch_rule checks
    try:
        DeepSpeedConfig(single)
    except (AssertionError, ValueError, TypeError, ValidationError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "bfloat16 and fp16" in text:
            problems.append(Problem("bf16.enabled", "fp16 and bf16 are both enabled; enable exactly one"))
        elif "train_batch_size or train_micro_batch_size_per_gpu" in text:
            problems.append(Problem("train_micro_batch_size_per_gpu", "neither it nor train_batch_size is set; "
                                                                      "DeepSpeed needs one of them: set it"))
        else:
            problems.append(Problem("deepspeed", f"DeepSpeed rejects the config: {text}"))
    return problems + _dtype_names(config)


def _dtype_names(config: dict) -> list[Problem]:
    """data_types.grad_accum_dtype: DeepSpeedConfig keeps the string and only the engine looks it up (DtypeEnum)."""
    from deepspeed.runtime.config import DtypeEnum

    types = config.get("data_types")
    value = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    try:
        DtypeEnum(value) if value is not None else None
    except (ValueError, TypeError):
        names = [member.name for member in DtypeEnum]
        return [Problem("data_types.grad_accum_dtype", f"{value!r} is not a dtype DeepSpeed knows; valid: "
                                                       f"{', '.join(names)}")]
    return []


def _ranks_per_replica(config: dict, pp: int) -> tuple[int, str]:
    """(ranks sharing one data-parallel replica's batch, how they multiply): AutoTP, pipeline and Ulysses ranks."""
    tp = int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)
    sp = config.get("sequence_parallel_size", 1)
    sp = sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 0 else 1
    return tp * pp * sp, ("tp x pp x sp" if sp > 1 else "tp x pp")


def _batch_rule(config: dict, world_size: int, pp: int) -> list[Problem]:
    replica, named = _ranks_per_replica(config, pp)
    if world_size % replica:
        return [Problem("--world-size", f"{world_size} is not divisible by {named} = {replica}")]
    dp = world_size // replica
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps", 1 if train is None or micro is None else None)
    if "auto" in (train, micro, accum):
        return []
    if train is not None and micro is not None and accum is not None and train != micro * accum * dp:
        fix = micro * accum * dp
        return [Problem("train_batch_size", f"{train} != micro {micro} x accumulation {accum} x dp {dp} = {fix} "
                                            f"at world size {world_size}; set train_batch_size to {fix}")]
    if train is not None and micro is not None and train % (micro * dp):
        return [Problem("train_batch_size", f"{train} is not divisible by micro {micro} x dp {dp}")]
    if train is not None and micro is None and train % (accum * dp):  # DeepSpeed derives micro = train / (accum x dp)
        return [Problem("train_batch_size", f"{train} is not divisible by accumulation {accum} x dp {dp} at world size "
                                            f"{world_size}; set train_batch_size to a multiple of {accum * dp}")]
    return []


def _zero_rules(config: dict, world_size: int, pp: int) -> list[Problem]:
    """Rules on the ZeRO section as DeepSpeed parsed it (its defaults and "auto" handling applied)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
    stage = int(zero.stage)
    offload = {"offload_param": zero.offload_param, "offload_optimizer": zero.offload_optimizer}
    device = {name: str(getattr(section.device, "value", section.device)) if section else "none"
              for name, section in offload.items()}
    problems = []
    if (pp > 1 or "pipeline" in config) and stage >= 2:
        problems.append(Problem("zero_optimization.stage", f"ZeRO-{stage} cannot run with pipeline parallelism; use 0 or 1"))
    if device["offload_param"] != "none" and stage != 3:
        problems.append(Problem("zero_optimization.offload_param",
                                f"parameter offload needs stage 3, not {stage}; set stage 3 or remove offload_param"))
    if device["offload_optimizer"] != "none" and stage == 0:
        problems.append(Problem("zero_optimization.offload_optimizer",
                                "optimizer offload needs stage 1, 2 or 3, not 0; raise the stage or remove "
                                "offload_optimizer"))
    for name, section in offload.items():
        if device[name] == "nvme" and not section.nvme_path:
            problems.append(Problem(f"zero_optimization.{name}.nvme_path",
                                    "nvme offload needs a local NVMe path; set nvme_path to a directory on a local "
                                    "NVMe drive"))
    hpz = zero.zero_hpz_partition_size
    if hpz > 1 and stage != 3:
        problems.append(Problem("zero_optimization.zero_hpz_partition_size",
                                f"{hpz}: hpZ (ZeRO++) partitions parameters, which only stage 3 does; set stage 3 or "
                                f"zero_hpz_partition_size 1"))
    elif hpz > 1 and world_size % min(hpz, world_size):
        problems.append(Problem("zero_optimization.zero_hpz_partition_size",
                                f"{hpz} does not divide world size {world_size}; use the GPUs per node"))
    for flag in ("zero_quantized_weights", "zero_quantized_gradients"):
        if getattr(zero, flag) and stage != 3:
            problems.append(Problem(f"zero_optimization.{flag}", f"ZeRO++ quantized communication needs stage 3, not "
                                                                 f"{stage}; set stage 3 or remove {flag}"))
    return problems


def _checkpoint_writer_rules(config: dict) -> list[Problem]:
    """DeepSpeed's decoupled checkpoint engine (checkpoint.writer.decoupled) writes a save's files in a process of its
    own after save_checkpoint returns and commits them at the next step: the manifest the toolkit writes when the
    HF Trainer's save returns would list files not yet written, and `latest` would move to them. On CPU ranks its
    writer process also fails as it starts (DeepSpeed 0.19.8: pin_memory, "Cannot access accelerator device when none
    is available"), after which each save writes nothing until the next step's commit fails."""
    writer = (config.get("checkpoint") or {}).get("writer")
    if isinstance(writer, dict) and writer.get("decoupled"):
        return [Problem("checkpoint.writer.decoupled", "is true: DeepSpeed's decoupled engine writes a checkpoint "
                                                       "after the HF Trainer's save returns, when the toolkit has "
                                                       "already written its manifest and moved `latest`; remove it "
                                                       "(the HF Trainer's DeepSpeed saves are synchronous)")]
    return []


def _scheduler_rules(config: dict) -> list[Problem]:
    params = (config.get("scheduler") or {}).get("params") or {}
    warmup = params.get("warmup_num_steps")
    if warmup is not None and warmup != "auto" and (not isinstance(warmup, int) or warmup < 1):
        return [Problem("scheduler.params.warmup_num_steps", f"{warmup!r}: DeepSpeed >= 0.19.6 rejects warm-up steps "
                                                             f"below 1 at launch; set it to 1 for no warm-up")]
    return []


def deepspeed_plan_view(config: dict) -> dict[str, tuple[str, object]]:
    """The plan options a DeepSpeed JSON states: option -> (the file's dotted key, its value); "auto" values (HF
    fills them from the trainer arguments) are left out."""
    zero = config.get("zero_optimization") or {}
    offload = {name: zero.get(section) or {} for name, section in (("offload_optimizer", "offload_optimizer"),
                                                                     ("offload_params", "offload_param"))}
    bf16, fp16 = ((config.get(section) or {}).get("enabled") for section in ("bf16", "fp16"))
    view = {
        "backend": ("deepspeed.json", "deepspeed"),
        "zero": ("zero_optimization.stage", zero.get("stage", 0)),
        "micro_batch": ("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu")),
        "grad_accum": ("gradient_accumulation_steps", config.get("gradient_accumulation_steps")),
        "global_batch": ("train_batch_size", config.get("train_batch_size")),
        "tp": ("tensor_parallel.autotp_size", int((config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1)),
        "sp": ("sequence_parallel_size", config.get("sequence_parallel_size", 1)),
        "offload_optimizer": ("zero_optimization.offload_optimizer.device",
                              offload["offload_optimizer"].get("device", "none")),
        "offload_params": ("zero_optimization.offload_param.device", offload["offload_params"].get("device", "none")),
        "nvme_path": ("zero_optimization.offload_optimizer.nvme_path",
                      offload["offload_optimizer"].get("nvme_path") or offload["offload_params"].get("nvme_path")),
    }
    if "auto" not in (bf16, fp16):
        view["precision"] = ("bf16.enabled", "bf16" if bf16 else "fp16" if fp16 else "fp32")
    return {name: (key, value) for name, (key, value) in view.items() if value is not None and value != "auto"}


def memory_problem(config: dict, model, gpu, world_size: int, seq_len: int, recompute: str, pp: int = 1):
    """The toolkit's memory model applied to the config's layout: a Problem when it does not fit the GPU."""
    options = {name: value for name, (_, value) in deepspeed_plan_view(config).items() if name != "grad_accum"}
    if "micro_batch" not in options:  # DeepSpeed derives it: train_batch_size / (accumulation x dp)
        dp = max(1, world_size // _ranks_per_replica(config, pp)[0])
        options["micro_batch"] = max(1, config.get("train_batch_size", 1) // (config.get("gradient_accumulation_steps", 1) * dp))
    plan = resolve_plan(model, world_size, **{**options, "backend": "deepspeed"}, seq_len=seq_len, pp=pp,
                        recompute=recompute)
    memory = estimate_memory(model, plan)
    if memory.total > gpu.memory_bytes:
        return Problem("memory", f"{memory.total / 2**30:.1f} GiB per GPU estimated for {model.name} at seq {seq_len}, "
                                 f"{gpu.name} has {gpu.memory_bytes / 2**30:.1f} GiB; raise the ZeRO stage, offload, "
                                 f"recompute or lower train_micro_batch_size_per_gpu")
    return None


def validate_deepspeed_config(config: dict, world_size: int, pp: int = 1, trainer_args: dict | None = None,
                              memory_check=None, config_path: Path | None = None) -> list[Problem]:
    """All problems of `config` at `world_size`. "auto" values are filled from `trainer_args` as HF Trainer fills them
    (or left to DeepSpeed's defaults without it); `memory_check(config) -> Problem | None` adds the fit estimate."""
    if not isinstance(config, dict):
        return [Problem("deepspeed", "the file must hold a JSON object")]
    problems = _unknown_keys(config)
    bad_batch = _batch_values(config)
    if bad_batch:  # the batch arithmetic below needs numbers
        return problems + bad_batch
    dp = max(1, world_size // _ranks_per_replica(config, pp)[0])
    if trainer_args is not None:
        problems += trainer_problems(config, trainer_args, dp, config_path)
        if not isinstance(trainer_args, dict):
            return problems
    filled = fill_auto(config, trainer_args, dp)
    reported = {p.key for p in problems}  # a batch size the trainer comparison already flagged is not repeated
    library = _library_checks(filled)
    problems += library + [p for p in _batch_rule(filled, world_size, pp) if p.key not in reported]
    if not library:  # the launch-time ZeRO rules need the types DeepSpeed's classes just accepted
        problems += _zero_rules(filled, world_size, pp)
    problems += _scheduler_rules(filled) + _checkpoint_writer_rules(filled)
    if memory_check is not None and not problems:
        found = memory_check(filled)
        if found is not None:
            problems.append(found)
    return problems


def finetune_problems(config: dict, method: str) -> list[Problem]:
    """What a LoRA / QLoRA run (`method`) meets only when it saves: under ZeRO-3 without gathering the 16-bit weights
    on save, the HF Trainer writes the adapter from an empty state dict (transformers trainer.py save_model), so every
    checkpoint's adapter_model.safetensors holds nothing. DeepSpeed's default is not to gather."""
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    if method == "full" or zero.get("stage") != 3:
        return []
    key = "stage3_gather_16bit_weights_on_model_save"
    if zero.get(key) is True:
        return []
    return [Problem(f"zero_optimization.{key}", f"is {zero.get(key, 'unset (false)')} under ZeRO-3: the HF Trainer "
                                                f"would save the {method} adapter empty (nothing gathers the "
                                                f"partitions); set it to true")]
