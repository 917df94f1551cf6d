"""Fine-tuning without a launch: the masked labels of rendered examples, packing that keeps examples apart, the options
derived into every command and the recipe, plan.json's record, the estimate of a frozen base, and the guards against
the known silent failures (a uint8 4-bit base under sharding, checkpointed layers that pass no gradient to adapters)."""

import json

import pytest
import yaml

from helpers import ROOT
from toolkit.cli.main import main
from toolkit.errors import UserInputError

torch = pytest.importorskip("torch")
LORA = ROOT / "recipes" / "tiny-llama-lora-cpu.yaml"
QLORA = ROOT / "recipes" / "tiny-llama-qlora-cpu.yaml"


@pytest.fixture(scope="module")
def chat():
    from toolkit.backends.data import build_tokenizer, load_rows, load_texts
    from toolkit.spec.recipe import load_recipe

    recipe = load_recipe(LORA)
    return recipe, build_tokenizer(recipe, load_texts(recipe)), load_rows(recipe)


def test_a_rendered_chat_example_trains_on_the_assistant_tokens_only(chat):
    from toolkit.backends.sft_data import IGNORE_INDEX, tokenized_examples

    recipe, tokenizer, rows = chat
    example = next(i for i in range(len(rows)) if len(rows[i]["messages"]) == 5)  # system, user, assistant x 2
    tokens = tokenized_examples(recipe, tokenizer, rows.select([example]))[0]
    messages = rows[example]["messages"]
    text = tokenizer.decode(tokens["input_ids"])
    assert text.startswith(f"<|im_start|>system\n{messages[0]['content']}<|im_end|>\n<|im_start|>user\n")
    trained = [t if label != IGNORE_INDEX else None for t, label in zip(tokens["input_ids"], tokens["labels"])]
    spans, current = [], []
    for token in trained + [None]:
        if token is None and current:
            spans.append(tokenizer.decode(current))
            current = []
        elif token is not None:
            current.append(token)
    assert spans == [f"{messages[2]['content']}<|im_end|>", f"{messages[4]['content']}<|im_end|>"]
    assert all(label == IGNORE_INDEX or label == token for token, label in zip(tokens["input_ids"], tokens["labels"]))


def test_a_prompt_completion_example_trains_on_the_completion_and_eos_only(tmp_path):
    from toolkit.backends.data import build_tokenizer, load_rows, load_texts
    from toolkit.backends.sft_data import IGNORE_INDEX, tokenized_examples
    from toolkit.spec.recipe import load_recipe

    recipe = load_recipe(QLORA)
    tokenizer = build_tokenizer(recipe, load_texts(recipe))
    rows = load_rows(recipe).select([0])
    tokens = tokenized_examples(recipe, tokenizer, rows)[0]
    trained = [t for t, label in zip(tokens["input_ids"], tokens["labels"]) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == rows[0]["completion"] + tokenizer.eos_token
    assert tokens["labels"][: len(tokens["labels"]) - len(trained)] == [IGNORE_INDEX] * (len(tokens["labels"])
                                                                                        - len(trained))


def test_packed_examples_neither_attend_nor_predict_across_their_boundary(chat):
    """Two examples packed in one row give the logits each gives alone (position ids restart, transformers builds a
    block-diagonal mask from them), and the first token of the second is no label of the first's last."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.backends.sft_data import keep_examples_apart, sft_datasets
    from toolkit.spec.recipe import recipe_hf_config

    recipe, tokenizer, rows = chat
    train, _, collator = sft_datasets(recipe, tokenizer, rows, 128)
    row = next(r for r in train if len(r["seq_lengths"]) >= 2)
    batch = collator([row])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**recipe_hf_config(recipe)),
                                             attn_implementation="sdpa").eval()
    with torch.no_grad():  # with transformers' default KV cache the second example would see the first
        position_ids = batch["position_ids"]
        second = slice(row["seq_lengths"][0], sum(row["seq_lengths"][:2]))
        mixed = model(input_ids=batch["input_ids"], position_ids=position_ids).logits[0, second]
        assert not torch.allclose(mixed, model(input_ids=torch.tensor([row["input_ids"][second]])).logits[0])
    keep_examples_apart(model)  # what training does
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        start = 0
        for length in row["seq_lengths"]:
            alone = model(input_ids=torch.tensor([row["input_ids"][start:start + length]])).logits[0]
            torch.testing.assert_close(packed[start:start + length], alone, atol=1e-5, rtol=1e-5)
            assert batch["labels"][0, start] == -100  # nothing predicts an example's first token
            start += length


def test_every_fine_tuning_option_is_a_flag_of_every_plan_command_and_a_recipe_key(tmp_path):
    from toolkit.cli.main import build_parser
    from toolkit.spec.finetune import FINETUNE_NAMES, finetune_flag
    from toolkit.train import build_parser as train_parser

    flags = {finetune_flag(name) for name in FINETUNE_NAMES}
    assert flags == {"--finetune", "--lora-r", "--lora-alpha", "--lora-dropout", "--lora-target-modules"}
    for verb in ("estimate", "plan", "generate", "restore-test"):
        sub = build_parser(verb)._subparsers._group_actions[0].choices[verb]
        assert flags <= set(sub._option_string_actions), verb
    assert flags <= set(train_parser()._option_string_actions)
    recipe = yaml.safe_load(LORA.read_text())
    recipe["finetune"]["r"] = 0
    recipe["data"]["train_files"] = [str(LORA.parent / f) for f in recipe["data"]["train_files"]]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    from toolkit.spec.recipe import load_recipe

    with pytest.raises(UserInputError, match=r"r\.yaml: finetune\.r"):
        load_recipe(tmp_path / "r.yaml")


def _estimate(capsys, *flags) -> dict:
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_estimate_of_a_frozen_base(capsys):
    targets = ("--lora-target-modules", "q_proj,k_proj,v_proj,o_proj")
    full = _estimate(capsys, "--zero", "3")
    lora = _estimate(capsys, "--zero", "3", "--finetune", "lora", "--lora-r", "16", *targets)
    qlora = _estimate(capsys, "--zero", "3", "--finetune", "qlora", "--lora-r", "16", *targets)
    # Llama 3.1 8B, r 16 on q, k, v, o: 32 layers x 16 x ((4096 + 4096) x 2 + (4096 + 1024) x 2)
    assert lora["params"]["trainable"] == 32 * 16 * (2 * 8192 + 2 * 5120) == 13_631_488
    assert full["params"]["trainable"] == full["params"]["total"]
    total, adapters = full["params"]["total"], lora["params"]["trainable"]
    assert lora["memory_bytes"]["optimizer"] == 12 * adapters // 8  # fp32 master + 2 moments, ZeRO-3 over 8
    assert lora["memory_bytes"]["gradients"] == 2 * adapters // 8
    # the bf16 base's partition, and the adapters in fp32 (PEFT's upcast; ZeRO-3 keeps matrices this small whole)
    weights = 2 * total / 8 + 4 * adapters * (1 + 1 / 8)
    assert abs(lora["memory_bytes"]["weights"] - weights) < 0.01 * weights
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # what bitsandbytes quantises
    nf4 = (total - linear) * 2 / 8 + linear * 0.5 / 8 + linear * (1 / 64 + 4 / 64 / 256) + 2 * adapters * (1 + 1 / 8)
    assert abs(qlora["memory_bytes"]["weights"] - nf4) < 0.02 * nf4
    ratio = lora["step_time_breakdown_s"]["compute_s"] / full["step_time_breakdown_s"]["compute_s"]
    assert 0.66 < ratio < 0.75  # no weight-gradient GEMMs for the base (attention's s^2 work stays)


def test_rules_between_the_method_and_the_plan(capsys):
    cases = [(("--backend", "megatron", "--finetune", "lora"), "--finetune: lora trains PEFT adapters"),
             (("--zero", "3", "--finetune", "qlora", "--offload-params", "cpu"), "--offload-params: a 4-bit base"),
             (("--finetune", "lora", "--lora-target-modules", "c_attn"), "'c_attn' names no linear module of llama")]
    for flags, message in cases:
        assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", *flags]) == 2
        assert message in capsys.readouterr().err


def test_plan_json_records_the_method_and_a_changed_one_is_refused(tmp_path, capsys):
    from toolkit.validate.generated import read_generated

    out = tmp_path / "gen"
    assert main(["generate", str(QLORA), "--out", str(out)]) == 0
    record = json.loads((out / "plan.json").read_text())
    assert record["plan"]["finetune"]["method"] == "qlora" and record["params"]["trainable"] == 18688
    assert read_generated(out / "plan.json").plan.finetune.method == "qlora"
    record["plan"]["finetune"]["method"] = "lora"
    (out / "plan.json").write_text(json.dumps(record))
    with pytest.raises(UserInputError, match="plan.finetune is .*'lora'.* but the recipe gives .*'qlora'"):
        read_generated(out / "plan.json")
    assert main(["generate", str(LORA), "--out", str(tmp_path / "g2"), "--recompute", "full"]) == 0
    trainer = json.loads((tmp_path / "g2" / "trainer_args.json").read_text())
    assert trainer["activation_checkpointing_kwargs"] == {"use_reentrant": False}


def test_a_4bit_base_stored_as_uint8_is_refused_before_sharding(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from toolkit.backends.peft_model import check_quant_storage
    from toolkit.spec.finetune import FinetuneOptions
    from toolkit.spec.model import spec_from_hf_dict
    from toolkit.spec.plan import resolve_plan
    from toolkit.spec.recipe import load_recipe, recipe_hf_config

    config = recipe_hf_config(load_recipe(QLORA))
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(tmp_path / "base")
    plan = resolve_plan(spec_from_hf_dict(config, "tiny"), 2, zero=3, finetune=FinetuneOptions(method="qlora"))
    uint8 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")  # bitsandbytes' default storage
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=uint8, dtype=torch.bfloat16)
    with pytest.raises(UserInputError, match="stored as torch.uint8, but sharded training needs "
                                             "bnb_4bit_quant_storage = torch.bfloat16"):
        check_quant_storage(model, plan)


def test_checkpointed_layers_of_a_frozen_base_pass_gradients_to_every_adapter():
    """The failure: reentrant checkpointing of a frozen base whose inputs need no grad cuts the graph (no gradient for
    the adapters inside; here every layer, so backward finds nothing to differentiate). What the toolkit sets on its
    own (non-reentrant as trainer_args.json says, input grads enabled by the backend) reaches every adapter; the
    checkpointing is installed below transformers' own guard, which would hide the difference."""
    import functools

    from peft import get_peft_model
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.backends.peft_model import lora_config
    from toolkit.spec.finetune import FinetuneOptions
    from toolkit.spec.recipe import load_recipe, recipe_hf_config

    config = AutoConfig.for_model(**recipe_hf_config(load_recipe(LORA)), use_cache=False)

    def adapter_grads(reentrant: bool, input_grads: bool) -> list:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        if input_grads:
            model.enable_input_require_grads()
        model = get_peft_model(model, lora_config(FinetuneOptions(method="lora", r=4)))
        model.base_model.model._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=reentrant))
        model.train()
        ids = torch.arange(1, 17)[None]
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for name, p in model.named_parameters() if "lora_B" in name]

    with pytest.raises(RuntimeError, match="does not require grad"):
        adapter_grads(reentrant=True, input_grads=False)
    generated = adapter_grads(reentrant=False, input_grads=True)
    assert len(generated) == 14 and all(grad is not None and grad.abs().max() > 0 for grad in generated)


def test_dmt_validate_refuses_a_zero3_config_that_would_save_the_adapter_empty(tmp_path, capsys):
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    assert main(["validate", str(tmp_path / "ds.json"), "--world-size", "2"]) == 0  # full training: fine
    assert main(["validate", str(tmp_path / "ds.json"), "--world-size", "2", "--finetune", "lora"]) == 2
    assert "stage3_gather_16bit_weights_on_model_save: is unset (false) under ZeRO-3" in capsys.readouterr().err
