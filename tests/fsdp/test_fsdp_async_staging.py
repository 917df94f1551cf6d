"""FSDP2's background save (toolkit.compat.dcp_async): the state is copied by a staging thread while training goes on,
and the checkpoint holds the values of the step it was saved at once the caller waited for that copy, whatever the
optimizer does afterwards. One process (a gloo group of one), a real fully_shard model and Adam, DCP's own reader."""

import threading

import torch


def test_a_background_save_holds_the_step_it_was_saved_at(tmp_path, gloo_group_of_one):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from toolkit.compat.dcp_async import GroupPool, dcp_saves_in_background

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    saved = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    expected = {k: v.full_tensor().clone() for k, v in saved["model"].items()}

    writes, staged, in_writer = [], [], []
    with dcp_saves_in_background(GroupPool(), writes, staged, lambda: in_writer.append(threading.current_thread())):
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")),
                 planner=dcp.DefaultSavePlanner())
    assert len(writes) == len(staged) == 1
    for future in staged:  # what training does before its next optimizer step
        future.result()
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()  # the live parameters change while the write may still run
    writes[0].result()
    assert in_writer and in_writer[0] is not threading.main_thread()  # written by a thread of this rank

    live = get_model_state_dict(model)
    assert any(not torch.equal(live[k].full_tensor(), expected[k]) for k in expected)
    loaded = {"model": {k: torch.zeros_like(v.full_tensor()) for k, v in live.items()}}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    for key, value in expected.items():
        assert torch.equal(loaded["model"][key], value), key
