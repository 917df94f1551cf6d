"""Measure the bytes autograd keeps for backward during one forward pass (needs torch; used by tests and benchmarks)."""

from __future__ import annotations

from toolkit.compat.torch_seams import live_storage_mode


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
    with live_storage_mode() as live:
        run()
    return live.peak, live.at
