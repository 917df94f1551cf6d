"""What Megatron-Core's MoE layers did in a run: the experts each rank holds, the tokens routed to each expert in a
step, the imbalance over the expert-parallel ranks, the router's auxiliary losses and its expert bias.

Everything is read from Megatron-Core's own objects: each MoELayer's `local_expert_indices` and expert parameters,
its router's output (the routing map, through a forward hook), Megatron-Core's aux-loss tracker (read and cleared by
its `track_moe_metrics`, as Megatron-LM's loop does each step) and the router's `expert_bias` (updated by
finalize_model_grads when the config enables it).

The imbalance is the planner's `moe_imbalance` (toolkit/spec/options.py) as measured: in each MoE layer, the tokens
routed to the busiest expert-parallel rank (the experts it holds: Megatron-Core gives EP rank r the contiguous block
r * E/EP ...) over the mean of the EP ranks; a step's figure is its worst layer's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

LAYOUT_FILE = "moe_layout.json"


def moe_layers(models: list) -> list:
    """(name, MoELayer) of every MoE layer in this rank's model chunks."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [(name, module) for chunk in models for name, module in chunk.named_modules() if isinstance(module, MoELayer)]


def write_expert_layout(models: list, output_dir: Path) -> dict | None:
    """moe_layout.json (rank 0; a collective): for every rank, its EP/ETP/TP coordinates and, per MoE layer, the
    global indices of the experts it holds and the shapes of their parameters, as Megatron-Core built them. None
    (nothing written) for a dense model."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    layers = moe_layers(models)
    if not layers:
        return None
    local = {
        "rank": dist.get_rank(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "etp_rank": parallel_state.get_expert_tensor_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "layers": {name.removeprefix("module."): {
            "layer_number": layer.layer_number,
            "experts": list(layer.local_expert_indices),
            "dispatcher": type(layer.token_dispatcher).__name__,
            "expert_parameters": {key: list(param.shape) for key, param in layer.experts.named_parameters()},
        } for name, layer in layers},
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, local)
    layout = {"num_experts": layers[0][1].config.num_moe_experts,
              "ep": parallel_state.get_expert_model_parallel_world_size(),
              "etp": parallel_state.get_expert_tensor_parallel_world_size(), "ranks": ranks}
    if dist.get_rank() == 0:
        path = Path(output_dir) / LAYOUT_FILE
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(layout, indent=1))
        partial.replace(path)
    return layout


class RoutingMetrics:
    """Per-step MoE figures of this rank's MoE layers (attach once after the model is built; `collect` every step,
    on every rank: it is a collective)."""

    def __init__(self, models: list, config):
        self.config = config
        self.layers = moe_layers(models)
        self.num_experts = config.num_moe_experts or 0
        self.counts: dict[int, object] = {}  # layer number -> routed tokens per expert this step (this rank's tokens)
        for _, layer in self.layers:
            layer.router.register_forward_hook(self._count(layer.layer_number))

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _count(self, layer_number: int):
        import torch

        def hook(module, args, output):
            # Megatron-Core's own rule for its routed-token counts (router._apply_expert_bias): only forwards that
            # train, so an activation recompute's second forward is not counted twice
            if not torch.is_grad_enabled():
                return
            routing_map = output[1]
            with torch.no_grad():
                counts = routing_map.sum(dim=0).to(torch.int64)
                previous = self.counts.get(layer_number)
                self.counts[layer_number] = counts if previous is None else previous + counts

        return hook

    def collect(self, step: int, num_microbatches: int) -> dict:
        """This step's figures for metrics.jsonl (the same on every rank; clears what the step accumulated)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        counts = torch.zeros(layers, self.num_experts, dtype=torch.int64)
        for number, value in self.counts.items():
            counts[number - 1] += value.cpu()
        self.counts = {}
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        counts = counts.to(device)
        # each data-parallel (and context-parallel) rank routes its own tokens; with sequence parallelism each TP
        # rank routes its share of the sequence; each pipeline stage its own layers
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if self.config.sequence_parallel:
            dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
        dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        counts = counts.cpu()
        routed = [number for number in range(layers) if counts[number].sum() > 0]
        ep = parallel_state.get_expert_model_parallel_world_size()
        per_ep_rank = counts[routed].view(len(routed), ep, self.num_experts // ep).sum(dim=2).double()
        imbalance = (per_ep_rank.max(dim=1).values / per_ep_rank.mean(dim=1)).max().item() if routed else None
        figures = {"moe_tokens_per_expert": counts[routed].tolist(), "moe_imbalance": imbalance}
        losses: dict = {}
        track_moe_metrics(loss_scale=1 / num_microbatches, iteration=step, total_loss_dict=losses,
                          num_layers=self.config.num_layers, moe_layer_freq=self.config.moe_layer_freq,
                          mtp_num_layers=self.config.mtp_num_layers)
        figures.update({f"moe_{name}": float(value) for name, value in losses.items()})
        bias = self._expert_bias(routed, layers, device)
        if bias is not None:
            figures["moe_expert_bias"] = bias
        return figures

    def _expert_bias(self, routed: list[int], layers: int, device) -> list | None:
        """The routers' expert bias after the step's update (DeepSeek-V3's auxiliary-loss-free balancing), one list
        per MoE layer; None where the routers keep none."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        if not self.config.moe_router_enable_expert_bias:
            return None
        bias = torch.zeros(layers, self.num_experts, dtype=torch.float64, device=device)
        for _, layer in self.layers:
            bias[layer.layer_number - 1] = layer.router.expert_bias.detach().to(device, torch.float64)
        dist.all_reduce(bias, group=parallel_state.get_pipeline_model_parallel_group())
        return bias.cpu()[routed].tolist()
