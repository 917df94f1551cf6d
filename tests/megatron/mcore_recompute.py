"""Launched by test_megatron_recompute.py under torchrun on 2 CPU ranks: one forward and backward of the same batch
and weights through Megatron-Core built from the generated megatron.yaml of each recompute plan (fp32, the recipe's
precision, and no recomputation in bf16 too); rank 0 saves the bytes autograd kept during the forward
(saved_tensors_hooks) and the gradients, and the most bytes alive at once in a forward and backward whose logits
outweigh the layers (the loss's peak). With --moe-recipe, a tiny qwen3_moe at EP 2 too: each rank's saved bytes, the
routed tokens its experts received in each MoE layer, and the dense and expert parameters and main-grad buffer
elements it holds."""

import argparse
from pathlib import Path

PLANS = {  # name: recipe plan overrides
    "none": dict(recompute="none"),
    "selective": dict(recompute="selective"),
    "selective:mlp": dict(recompute="selective", recompute_modules=["mlp"]),
    "full:block1": dict(recompute="full", recompute_num_layers=1),
    "full": dict(recompute="full"),
}


BF16 = dict(recompute="none", precision="bf16")
LOSS_PEAK = dict(recompute="full", precision="bf16")  # the loss's peak, on a vocabulary whose logits outweigh the rest
LOSS_VOCAB = 32000
# name: plan overrides of the MoE recipe: EP 2, and EP 2 folded over TP 2 (one group of 2 ranks is attention's TP
# group and the experts' EP group, ETP 1; MoE at TP > 1 needs sequence parallelism)
MOE_PLANS = {"ep2": dict(ep=2, recompute="none"),
             "folded": dict(tp=2, ep=2, etp=1, sequence_parallel=True, recompute="none")}


def run_plan(recipe, model, overrides: dict, tokens, weights):
    """(saved bytes, {name: grad}, the megatron.yaml transformer_config, weights) of one forward + backward."""
    import torch

    from toolkit.backends.megatron.build import build, destroy, unwrapped
    from toolkit.backends.megatron.training import megatron_yaml_for
    from toolkit.estimate.measure import saved_activation_bytes
    from toolkit.planner.recipe import recipe_plan

    plan = recipe_plan(recipe, model, **overrides)
    config = megatron_yaml_for(recipe, model, plan)
    setup = build(config)
    gpt = unwrapped(setup)[0]
    if weights is None:
        weights = {k: v.clone() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}
    gpt.load_state_dict(weights, strict=False)
    gpt.train()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    losses = []

    def forward():
        losses.append(gpt(tokens, positions, None, labels=tokens))
        return losses[-1]

    class Forward(torch.nn.Module):  # saved_activation_bytes takes a module; its parameters are the model's
        def __init__(self):
            super().__init__()
            self.gpt = gpt

        def forward(self):
            return forward()

    measured = saved_activation_bytes(Forward())
    losses.clear()
    forward().float().mean().backward()
    grads = {name: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().clone()
             for name, p in gpt.named_parameters()}
    tc = config["transformer_config"]
    recompute = {k: tc.get(k) for k in ("recompute_granularity", "recompute_method", "recompute_num_layers",
                                        "recompute_modules")}
    destroy()
    return measured, grads, recompute, weights


def run_moe_plan(recipe, model, overrides: dict) -> dict:
    """What one rank holds and keeps for one forward of the MoE recipe's model at `overrides` (each rank its own
    batch, as data parallelism gives it): saved bytes, routed tokens per MoE layer, parameters and main-grad
    elements, dense and expert (Megatron-Core marks expert parameters allreduce=False)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import SequentialMLP

    from toolkit.backends.megatron.build import build, destroy, unwrapped
    from toolkit.backends.megatron.training import megatron_yaml_for
    from toolkit.estimate.measure import saved_activation_bytes
    from toolkit.planner.recipe import recipe_plan

    plan = recipe_plan(recipe, model, **overrides)
    setup = build(megatron_yaml_for(recipe, model, plan))
    gpt = unwrapped(setup)[0]
    gpt.train()
    # the ranks of a TP group read the same batch
    tokens = torch.randint(0, model.vocab_size, (plan.micro_batch, recipe.training.seq_len),
                           generator=torch.Generator().manual_seed(parallel_state.get_data_parallel_rank()))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    received: list[int] = []
    for module in gpt.modules():
        if isinstance(module, SequentialMLP):
            module.register_forward_hook(lambda mod, args, out: received.append(int(args[0].shape[0])))

    class Forward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = gpt

        def forward(self):
            return gpt(tokens, positions, None, labels=tokens)

    saved = saved_activation_bytes(Forward())
    params = {"dense": 0, "expert": 0}
    for p in gpt.parameters():
        params["dense" if getattr(p, "allreduce", True) else "expert"] += p.numel()
    grad_elements = sum(p.main_grad.numel() for p in gpt.parameters() if getattr(p, "main_grad", None) is not None)
    destroy()
    # the tokens a rank routes: its part of the sequence under sequence parallelism
    routes = plan.micro_batch * plan.seq_len // (plan.tp if plan.sequence_parallel else 1)
    return dict(saved_bytes=saved, received=received, params=params, grad_elements=grad_elements, tokens=routes)


def loss_peak(recipe, model, tokens) -> tuple[int, str]:
    """(the most bytes alive at once in a forward and backward, the op at that moment) of a build whose logits
    outweigh its layers."""
    from toolkit.backends.megatron.training import megatron_step_peaks
    from toolkit.planner.recipe import recipe_plan

    return megatron_step_peaks(recipe, model, recipe_plan(recipe, model, **LOSS_PEAK), tokens)["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--loss-recipe", type=Path, required=True, help="the recipe with a LOSS_VOCAB vocabulary")
    parser.add_argument("--moe-recipe", type=Path, help="a tiny MoE recipe to measure at MOE_PLANS")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from toolkit.backends.megatron.build import init_distributed
    from toolkit.compat.megatron_cpu import cuda_on_cpu
    from toolkit.spec.recipe import load_recipe, recipe_model

    recipe = load_recipe(args.recipe)
    model = recipe_model(recipe)
    micro = recipe.plan.micro_batch
    tokens = torch.randint(0, model.vocab_size, (micro, recipe.training.seq_len),
                           generator=torch.Generator().manual_seed(0))
    init_distributed()
    results, weights = {}, None
    with cuda_on_cpu():
        for name, overrides in PLANS.items():
            measured, grads, recompute, weights = run_plan(recipe, model, overrides, tokens, weights)
            results[name] = dict(saved_bytes=measured, grads=grads, megatron=recompute)
        bf16_saved = run_plan(recipe, model, BF16, tokens, weights)[0]
        loss_recipe = load_recipe(args.loss_recipe)
        peak = loss_peak(loss_recipe, recipe_model(loss_recipe), torch.randint(0, LOSS_VOCAB, tuple(tokens.shape)))
        moe = {}
        if args.moe_recipe is not None:
            moe_recipe = load_recipe(args.moe_recipe)
            for name, overrides in MOE_PLANS.items():
                ranks = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, run_moe_plan(moe_recipe, recipe_model(moe_recipe), overrides))
                moe[name] = ranks
    if dist.get_rank() == 0:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"plans": results, "bf16_none_saved_bytes": bf16_saved, "loss_peak": peak, "moe": moe},
                   args.output_dir / "recompute.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
