"""Launched by test_megatron_logits.py under torchrun on 2 CPU ranks: the logits of one fixed batch for the weights
of one dist checkpoint loaded at TP=2 and at TP=1 (DP=2), and of a fresh TP=1 model; rank 0 saves them."""

import argparse
from pathlib import Path


def logits_at(recipe, model, tp: int, checkpoint: Path | None, tokens):
    """Full-vocabulary logits of `tokens` (gathered over TP), with the checkpoint's weights unless it is None."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from toolkit.backends.megatron.build import build, unwrapped
    from toolkit.backends.megatron.checkpoint import load_checkpoint
    from toolkit.backends.megatron.training import megatron_yaml_for
    from toolkit.planner.recipe import recipe_plan

    plan = recipe_plan(recipe, model, tp=tp)
    config = megatron_yaml_for(recipe, model, plan)
    setup = build(config)
    if checkpoint is not None:
        load_checkpoint(setup, checkpoint, plan)
    gpt = unwrapped(setup)[0].eval()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(gpt(tokens, positions, None))
    return logits[..., : config["model"]["vocab_size"]].clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from toolkit.backends.megatron.build import destroy, init_distributed
    from toolkit.compat.megatron_cpu import cuda_on_cpu
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(args.recipe)
    model = recipe_model(recipe)
    tokens = torch.randint(0, model.vocab_size, (2, recipe.training.seq_len), generator=torch.Generator().manual_seed(0))
    init_distributed()
    with cuda_on_cpu():
        results = {"tp2": logits_at(recipe, model, 2, args.checkpoint, tokens),
                   "tp1": logits_at(recipe, model, 1, args.checkpoint, tokens),
                   "fresh": logits_at(recipe, model, 1, None, tokens)}
        destroy()
    if dist.get_rank() == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.output_dir / "logits.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
