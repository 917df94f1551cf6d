"""checkpoint.local's contract with the libraries, in one process on CPU (gloo): NVRx 0.4.1's LocalCheckpointManager
saves and loads Megatron-Core's MCoreTensorAwareStateDict (toolkit.backends.megatron.local's ALGO) without CUDA, and
`dmt ckpt verify` checks the files it writes. The training loop's use of it is the Megatron-Core in-process restart
test (tests/megatron/test_megatron_train.py)."""

from pathlib import Path

import pytest
import torch
from test_fuzz_checkpoints import POINTED

from toolkit.backends.megatron.local import ALGO
from toolkit.checkpoint.allow_lists import REFUSED
from toolkit.checkpoint.verify import NVRX_LOCAL, inspect, verify


def _sharded(weight, bias):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    return {"model": {"w": ShardedTensor.from_rank_offsets("model.w", weight, replica_id=0),
                      "b": ShardedTensor.from_rank_offsets("model.b", bias, replica_id=0)},
            "rng_state": ShardedObject("rng_state", {"torch": torch.get_rng_state()}, (1,), (0,), replica_id=0),
            "iteration": 3, "scheduler": {"num_steps": 3}}


def test_nvrx_local_manager_saves_and_loads_a_megatron_state_on_cpu_and_verify_checks_its_files(tmp_path,
                                                                                                 gloo_group_of_one):
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    weight, bias = torch.randn(4, 3), torch.randn(4)
    aware, _ = MCoreTensorAwareStateDict.from_state_dict(_sharded(weight, bias), algo=ALGO)
    LocalCheckpointManager(tmp_path, session_id="run").save(aware, 3, is_async=False)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.pt"))
    assert files == ["run/0/iter_0000003_0_local.pt"]

    manager = LocalCheckpointManager(tmp_path, session_id="run")  # a restarted process: what is on disk
    assert manager.find_latest() == 3
    loaded, ckpt_id = manager.load()
    assert ckpt_id == (3, 0, "run")
    state = loaded.to_state_dict(_sharded(torch.zeros(4, 3), torch.zeros(4)), algo=ALGO)
    assert torch.equal(state["model"]["w"], weight) and torch.equal(state["model"]["b"], bias)
    assert state["iteration"] == 3 and state["scheduler"] == {"num_steps": 3}
    assert torch.equal(state["rng_state"]["torch"], torch.get_rng_state())

    report = verify(tmp_path)
    assert report.ok and report.format == NVRX_LOCAL and report.files_checked == 1, report.problems
    assert inspect(tmp_path / "run")["local_checkpoints"][0]["step"] == 3
    # another rank's directory holding only an older step, and a save that never finished: both named
    (tmp_path / "run" / "1").mkdir()
    (tmp_path / "run" / "1" / "iter_0000002_1_local.pt").write_bytes(b"x")
    (tmp_path / "run" / "1" / "iter_0000003_1_local.dirty.pt").write_bytes(b"x")
    problems = [p["problem"] for p in verify(tmp_path).problems]
    assert any("did not finish (.dirty)" in p for p in problems), problems
    assert any("no step every rank holds" in p and "0: [3]" in p and "1: [2]" in p for p in problems), problems
    # a pickle naming anything beyond Megatron-Core's state classes is refused before NVRx's torch.load would run it
    torch.save({"x": Payload()}, tmp_path / "run" / "0" / "iter_0000004_0_local.pt")
    problems = verify(tmp_path).problems
    assert any("iter_0000004_0_local.pt" in p["file"] and "test_local_checkpoints.Payload" in p["problem"]
               and REFUSED in p["problem"] for p in problems), problems


@pytest.mark.parametrize("kind", sorted(POINTED))
def test_a_local_checkpoint_file_that_blocks_or_leads_out_is_reported_by_verify(tmp_path, gloo_group_of_one, kind):
    """A rank's local file made a FIFO, a link to /dev/zero or a link out of the directory: `dmt ckpt verify` (plain
    and --deep) names it and reads nothing from it, as for every other format (tests/unit/test_fuzz_checkpoints.py)."""
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    aware, _ = MCoreTensorAwareStateDict.from_state_dict(_sharded(torch.randn(4, 3), torch.randn(4)), algo=ALGO)
    LocalCheckpointManager(tmp_path / "local", session_id="run").save(aware, 3, is_async=False)
    file = tmp_path / "local" / "run" / "0" / "iter_0000003_0_local.pt"
    says = POINTED[kind](file, tmp_path / "outside")
    for deep in (False, True):
        problems = verify(tmp_path / "local", deep=deep).problems
        assert any(says in p["problem"] and "iter_0000003_0_local.pt" in p["file"] for p in problems), (deep, problems)


class Payload:
    """Stands for anything a hostile local checkpoint could name."""


def test_restore_test_compares_the_steps_after_the_local_checkpoint_the_resume_read(tmp_path, monkeypatch):
    """`dmt restore-test` with checkpoint.local: when the interrupted run wrote a local checkpoint after the persistent
    one it was killed at, the resumed run continues after it (incident.json's local_resume), and the comparison
    starts there, not at --save-at (those steps are neither trained again nor in the resumed metrics). The launches
    are stood in for by what they write (the real launch: the Megatron-Core in-process restart test)."""
    import json

    from toolkit.checkpoint import restore
    from toolkit.runtime.incident import append_incident

    def records(out, steps):
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "a") as handle:
            for step in steps:
                handle.write(json.dumps({"step": step, "loss": 10.0 / step, "grad_norm": 1.0, "learning_rate": 1e-3,
                                         "data_sha": f"sha{step}"}) + "\n")

    def run(cmd, log, timeout, name):
        out = Path(cmd[cmd.index("--output-dir") + 1])
        if "--resume" in cmd:  # the resume read the local checkpoint of step 5, newer than checkpoint-4
            append_incident(out, {"event": "local_resume", "step": 5, "dir": str(out / "local"),
                                  "persistent": "checkpoint-4"})
            records(out, range(6, 9))
        else:
            records(out, range(1, 9))
        return 0

    def killed(cmd, out, save_at, log, timeout):
        records(out, range(1, 6))
        return 5

    monkeypatch.setattr(restore, "_run", run)
    monkeypatch.setattr(restore, "_run_and_kill_after_save", killed)
    result = restore.restore_test(tmp_path / "recipe.yaml", tmp_path / "work", 8, 4, 2, launcher="torchrun")
    assert result.passed and result.identical and result.resumed_at == 5, result.mismatches
    assert result.reference_losses == [10.0 / s for s in (6, 7, 8)] and result.resumed_losses == result.reference_losses
    assert result.checkpoint == f"the local checkpoint of step 5 in {tmp_path / 'work' / 'interrupted' / 'local'}"
