"""LoRA and QLoRA under the HF Trainer: the frozen base (bf16, or 4-bit nf4 through bitsandbytes), PEFT's adapters on
it, and the checks that catch the known silent failures: a 4-bit base whose storage dtype sharding would mangle, an
adapter saved empty (ZeRO-3 without gathering), and adapters that got no gradient.

A run without pretrained weights (the tiny CPU recipes) fine-tunes a random base: it is made once from the recipe's
config and seed and saved to OUTPUT/base (safetensors + config), so that every rank, a resumed run, `dmt convert
merge-lora` and `PeftModel.from_pretrained` all find the same base.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from toolkit.compat.transformers_seams import without_deepspeed_config
from toolkit.errors import UserInputError
from toolkit.spec.backends import backend_of
from toolkit.spec.finetune import ALL_LINEAR, FinetuneOptions
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, recipe_hf_config

log = logging.getLogger(__name__)
BASE_DIR = "base"  # under the output directory: the random base a run without pretrained weights fine-tunes
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def training_dtype(plan: Plan):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision, torch.float32)


def lora_config(finetune: FinetuneOptions):
    """PEFT's LoraConfig of the plan's finetune options (no bias, causal LM)."""
    from peft import LoraConfig

    targets = ALL_LINEAR if finetune.target_modules == (ALL_LINEAR,) else list(finetune.target_modules)
    return LoraConfig(r=finetune.r, lora_alpha=finetune.alpha, lora_dropout=finetune.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


def quantization_config(plan: Plan):
    """QLoRA's 4-bit base: nf4 in blocks of 64, double-quantised scales, computing and storing in the training dtype
    (a float storage dtype is what lets ZeRO-3 and FSDP2 shard the packed weights like any other parameter)."""
    from transformers import BitsAndBytesConfig

    dtype = training_dtype(plan)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def base_source(recipe: Recipe, output_dir: Path, is_main: bool) -> str:
    """The pretrained weights, or the random base of this run (saved once by the main process, which the caller runs
    first)."""
    if recipe.model.pretrained:
        return recipe.locate(recipe.model.pretrained)
    base = output_dir / BASE_DIR
    if is_main and not (base / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, set_seed

        set_seed(recipe.training.seed)
        with _without_zero3_init():
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**recipe_hf_config(recipe)),
                                                     dtype=torch.float32)
        model.save_pretrained(base)
        log.info("random base of %s saved to %s", recipe.name, base)
    return str(base)


@contextlib.contextmanager
def _without_zero3_init():
    """One process builds the random base whole: under ZeRO-3 transformers would build it inside deepspeed.zero.Init,
    whose collectives wait for ranks that are not building anything (a hang). transformers decides by its module's
    reference to the DeepSpeed config the TrainingArguments registered, which is set aside meanwhile."""
    with without_deepspeed_config():
        yield


def check_quant_storage(model, plan: Plan) -> None:
    """Every 4-bit weight stored in the training dtype: with uint8 storage ZeRO-3 casts the packed bytes to floats
    and FSDP2 cannot shard them (a crash, or NaN gradients); a pre-quantised checkpoint brings its own setting."""
    expected = training_dtype(plan)
    for name, param in model.named_parameters():
        if type(param).__name__ == "Params4bit" and param.dtype != expected:
            raise UserInputError("model.pretrained", f"{name} is a 4-bit weight stored as {param.dtype}, but sharded "
                                                     f"training needs bnb_4bit_quant_storage = {expected} (the "
                                                     f"training dtype); quantise the base again from its bf16 weights")


def finetune_model(recipe: Recipe, plan: Plan, output_dir: Path, args):
    """The base (frozen, in the training dtype or 4-bit) with PEFT's LoRA adapters; input gradients enabled when
    activations are recomputed, so that checkpointed layers of a frozen base still pass gradients to the adapters."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with args.main_process_first(desc="fine-tuning base"):
        source = base_source(recipe, output_dir, args.process_index == 0)
    extra = {"quantization_config": quantization_config(plan)} if plan.finetune.method == "qlora" else {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=training_dtype(plan), attn_implementation=plan.attention,
                                                 **extra)
    if plan.finetune.method == "qlora":
        check_quant_storage(model, plan)
    if plan.recompute == "full":
        model.enable_input_require_grads()
    model = get_peft_model(model, lora_config(plan.finetune))
    trainable, total = model.get_nb_trainable_parameters()
    log.info("%s: %d trainable adapter parameters of %d (%.3f%%)", plan.finetune.method, trainable, total,
             100 * trainable / total)
    return model


def adapter_problems(checkpoint: Path, finetune: FinetuneOptions) -> list[str]:
    """What is wrong with a saved adapter: missing files, no tensors, empty tensors (ZeRO-3 partitions saved as they
    are), or a rank other than the plan's."""
    from safetensors import safe_open

    path = checkpoint / ADAPTER_FILE
    if not path.is_file() or not (checkpoint / ADAPTER_CONFIG).is_file():
        return [f"{checkpoint.name} has no {ADAPTER_FILE} and {ADAPTER_CONFIG}"]
    problems = []
    with safe_open(str(path), framework="pt") as handle:
        names = list(handle.keys())
        if not any("lora_A" in name for name in names):
            problems.append(f"{path} holds no lora_A tensors")
        for name in names:
            shape = handle.get_slice(name).get_shape()
            if 0 in shape or not shape:
                problems.append(f"{path}: {name} is empty {tuple(shape)}")
            elif "lora_A" in name and shape[0] != finetune.r:
                problems.append(f"{path}: {name} has rank {shape[0]}, the plan's r is {finetune.r}")
    return problems


def save_sharded_adapter(model, checkpoint: Path, is_main: bool) -> None:
    """FSDP2 checkpoints are DCP shards, and the HF Trainer writes no adapter beside them: every rank gathers the
    adapters' DTensor shards (small: only the adapters), the main process saves them as PEFT does."""
    from torch.distributed.tensor import DTensor

    adapters = {name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().cpu()
                for name, param in model.named_parameters() if param.requires_grad}
    if is_main:
        model.save_pretrained(checkpoint, state_dict=adapters)


def adapter_callback(plan: Plan):
    """After every save: FSDP2's adapter written beside its shards; then, on the main process, the adapter the
    checkpoint holds is whole (or training stops here, rather than after hours of saving nothing)."""
    from transformers import TrainerCallback

    finetune = plan.finetune
    hooks = backend_of(plan).train.TRAINER_HOOKS

    class AdapterCheck(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            hooks.save_adapter(model, checkpoint, state.is_world_process_zero)  # FSDP2's, beside its shards
            if not state.is_world_process_zero:
                return
            problems = adapter_problems(checkpoint, finetune)
            if problems:
                raise RuntimeError(f"the adapter saved at step {state.global_step} is not whole: {problems[0]}")

    return AdapterCheck()

