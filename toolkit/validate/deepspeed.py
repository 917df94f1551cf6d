"""Validate a DeepSpeed JSON the way DeepSpeed will, plus the rules it only hits at launch, and its agreement with
HF TrainingArguments. Every problem is reported at once, each naming the key, the conflicting values and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULER_STEP_KEYS = {"WarmupCosineLR": "total_num_steps", "WarmupDecayLR": "total_num_steps"}


@dataclass(frozen=True)
class Problem:
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def _import_deepspeed_quietly() -> None:
    """DeepSpeed's logger writes to the stdout it sees at import; bind it to stderr so --json output stays clean."""
    import contextlib
    import sys

    if "deepspeed" not in sys.modules:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401


def _library_checks(config: dict) -> list[Problem]:
    """DeepSpeed's own config classes: the ZeRO pydantic model and DeepSpeedConfig's sanity checks."""
    from pydantic import ValidationError

    _import_deepspeed_quietly()
    problems = []
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
    except ValidationError as exc:
        for err in exc.errors():
            key = ".".join(["zero_optimization", *(str(p) for p in err["loc"])])
            problems.append(Problem(key, err["msg"]))
    # DeepSpeedConfig asserts batch sizes against the world size it sees (1 here): our rule below checks the real one
    single = {k: v for k, v in config.items() if k != "train_batch_size"}
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        DeepSpeedConfig(single)
    except (AssertionError, ValueError, ValidationError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "bfloat16 and fp16" in text:
            problems.append(Problem("bf16.enabled", "fp16 and bf16 are both enabled; enable exactly one"))
        elif not any(p.key.startswith("zero_optimization") for p in problems):
            problems.append(Problem("deepspeed", f"DeepSpeed rejects the config: {text}"))
    return problems


def _batch_rule(config: dict, world_size: int, pp: int) -> list[Problem]:
    tp = int(config.get("tensor_parallel", {}).get("autotp_size", 1) or 1)
    if world_size % (tp * pp):
        return [Problem("--world-size", f"{world_size} is not divisible by tp x pp = {tp * pp}")]
    dp = world_size // (tp * pp)
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
    return []


def _zero_rules(config: dict, pp: int) -> list[Problem]:
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    problems = []
    if (pp > 1 or "pipeline" in config) and stage >= 2:
        problems.append(Problem("zero_optimization.stage", f"ZeRO-{stage} cannot run with pipeline parallelism; use 0 or 1"))
    if "offload_param" in zero and zero["offload_param"].get("device", "none") != "none" and stage != 3:
        problems.append(Problem("zero_optimization.offload_param", f"parameter offload needs stage 3, not {stage}"))
    if "offload_optimizer" in zero and zero["offload_optimizer"].get("device", "none") != "none" and stage == 0:
        problems.append(Problem("zero_optimization.offload_optimizer", "optimizer offload needs stage 1, 2 or 3"))
    for section in ("offload_param", "offload_optimizer"):
        offload = zero.get(section) or {}
        if offload.get("device") == "nvme" and not offload.get("nvme_path"):
            problems.append(Problem(f"zero_optimization.{section}.nvme_path", "nvme offload needs a local NVMe path"))
    return problems


def _trainer_rules(config: dict, trainer: dict, world_size: int) -> list[Problem]:
    """Every value HF TrainingArguments and the DeepSpeed JSON both state must agree ('auto' defers to HF)."""
    optimizer = config.get("optimizer", {}).get("params", {})
    scheduler = config.get("scheduler", {})
    pairs = [
        ("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu"), "per_device_train_batch_size"),
        ("gradient_accumulation_steps", config.get("gradient_accumulation_steps"), "gradient_accumulation_steps"),
        ("gradient_clipping", config.get("gradient_clipping"), "max_grad_norm"),
        ("bf16.enabled", config.get("bf16", {}).get("enabled", False), "bf16"),
        ("fp16.enabled", config.get("fp16", {}).get("enabled", False), "fp16"),
        ("optimizer.params.lr", optimizer.get("lr"), "learning_rate"),
        ("optimizer.params.eps", optimizer.get("eps"), "adam_epsilon"),
        ("optimizer.params.weight_decay", optimizer.get("weight_decay"), "weight_decay"),
    ]
    if "betas" in optimizer and optimizer["betas"] != "auto":
        pairs += [("optimizer.params.betas[0]", optimizer["betas"][0], "adam_beta1"),
                  ("optimizer.params.betas[1]", optimizer["betas"][1], "adam_beta2")]
    steps_key = SCHEDULER_STEP_KEYS.get(scheduler.get("type"))
    if steps_key:
        pairs.append((f"scheduler.params.{steps_key}", scheduler.get("params", {}).get(steps_key), "max_steps"))
    if scheduler.get("params", {}).get("warmup_num_steps") is not None:
        pairs.append(("scheduler.params.warmup_num_steps", scheduler["params"]["warmup_num_steps"], "warmup_steps"))
    problems = []
    for ds_key, ds_value, hf_key in pairs:
        if ds_value is None or ds_value == "auto" or hf_key not in trainer:
            continue
        if ds_value != trainer[hf_key]:
            problems.append(Problem(ds_key, f"{ds_value} in the DeepSpeed JSON but {hf_key}={trainer[hf_key]} in the "
                                            f"trainer arguments; make them equal (or set the DeepSpeed value to \"auto\")"))
    return problems


def validate_deepspeed_config(config: dict, world_size: int, pp: int = 1, trainer_args: dict | None = None,
                              memory_check=None) -> list[Problem]:
    """All problems of `config` at `world_size`; `memory_check(config) -> Problem | None` adds the fit estimate."""
    if not isinstance(config, dict):
        return [Problem("deepspeed", "the file must hold a JSON object")]
    problems = _library_checks(config) + _batch_rule(config, world_size, pp) + _zero_rules(config, pp)
    if trainer_args is not None:
        problems += _trainer_rules(config, trainer_args, world_size)
    if memory_check is not None and not problems:
        found = memory_check(config)
        if found is not None:
            problems.append(found)
    return problems
