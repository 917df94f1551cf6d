"""Measure the bytes autograd keeps for backward during one forward pass (needs torch; used by tests and benchmarks)."""

from __future__ import annotations


def saved_activation_bytes(model, **forward_kwargs) -> int:
    """Sum of distinct storages saved for backward by `model(**forward_kwargs)`, parameters excluded.

    Storages are deduplicated by (data pointer, size), so views of one tensor count once, as they occupy memory once.
    Parameters (and their views, e.g. a transposed weight kept by a linear) are model state, not activations.
    """
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[tuple[int, int], int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and storage.nbytes():
            seen[(ptr, storage.nbytes())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(**forward_kwargs)
    del output
    return sum(seen.values())



def peak_live_bytes(run) -> tuple[int, str]:
    """The largest sum of storages alive at once that the ops of `run()` returned (tensors made before it, such as
    parameters, left out), and the op that reached it: the allocator's peak where no allocator runs (CPU), as
    torch.cuda.max_memory_allocated() measures it on a GPU, less caching."""
    from toolkit.compat.torch_seams import live_storage_mode

    with live_storage_mode() as live:
        run()
    return live.peak, live.at


def megatron_step_peaks(recipe, model, plan, tokens) -> dict[str, tuple[int, str]]:
    """peak_live_bytes of Megatron-Core's GPT as toolkit/train.py builds it for `plan` (the generated megatron.yaml;
    its process groups must not exist yet, torch.distributed must): `forward` (one forward with labels) and `step`
    (forward and backward), each after a first forward and backward, which makes Megatron-Core's global memory
    buffer once. Run inside toolkit.compat.megatron_cpu.cuda_on_cpu() on CPU ranks."""
    import torch

    from toolkit.backends.megatron.build import build, destroy, unwrapped
    from toolkit.backends.megatron.training import megatron_yaml_for

    gpt = unwrapped(build(megatron_yaml_for(recipe, model, plan)))[0]
    gpt.train()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def forward():
        return gpt(tokens, positions, None, labels=tokens)

    def step():
        forward().float().mean().backward()

    step()
    peaks = {"forward": peak_live_bytes(forward), "step": peak_live_bytes(step)}
    destroy()
    return peaks
