"""What a Megatron-Core background save holds on a CPU rank (toolkit.compat.megatron_async.copied / released): one
copy of the state it writes, in shared memory (the worker's queue then passes handles, not a second copy), replacing
the tensors in the writer's own write buckets (the clones Megatron made of views go as the copies come), and dropped by
the rank once the worker has the request. A real dist_checkpointing async request on a gloo group of one process."""

import torch


def test_a_save_copies_the_state_once_into_shared_memory_and_the_rank_lets_it_go(tmp_path, gloo_group_of_one):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from toolkit.compat.megatron_async import _results_queue, copied, needs_copy, prepared, released

    _results_queue(filesystem_async)  # the toolkit's manager, as start_writer makes it
    flat = torch.arange(48, dtype=torch.float32)  # a buffer whose views are the parameters (Megatron's DDP keeps so)
    live = {"a": flat[:32].view(4, 8), "b": torch.ones(16)}
    state = {name: ShardedTensor.from_rank_offsets(name, tensor, replica_id=0) for name, tensor in live.items()}
    request = dist_checkpointing.save(state, str(tmp_path), async_sharded_save=True)
    buckets = request.async_fn_args[1]
    count = len(buckets)

    ready = prepared(request, lambda write, *args: write(*args))
    assert needs_copy(ready)  # a CPU rank: the worker's preload_fn would not copy these
    ready = copied(ready)
    written = [tensor for _path, _name, (_items, tensors) in ready.async_fn_args[1] for _item, tensor in tensors]
    assert ready.async_fn_args[1] is buckets and ready.preload_fn is not None  # the writer's own list, Megatron's
    assert len(written) == 2 and all(t.is_shared() for t in written)  # handshake kept
    assert {t.untyped_storage().data_ptr() for t in written}.isdisjoint(
        {flat.untyped_storage().data_ptr(), live["b"].untyped_storage().data_ptr()})  # copies, not the live state
    assert sorted(t.sum().item() for t in written) == sorted(t.sum().item() for t in live.values())
    flat.add_(1.0)  # training goes on: the copies keep the step they were made at
    assert sorted(t.sum().item() for t in written) == [16.0, sum(range(32))]

    released(ready)
    assert len(buckets) == count and all(not tensors for _path, _name, (_items, tensors) in buckets)
