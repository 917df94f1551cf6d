"""A checkpoint from elsewhere is data, never code: a crafted pickle in each checkpoint format (a DCP `.metadata`, a
DCP stored object, DeepSpeed's rank files, Megatron-Core's common.pt) whose unpickling would create a file runs
nothing under any verb that opens the format, and the file never appears. `dmt ckpt inspect` and the converters exit
2 with one line naming the file and the global the pickle asked for; `dmt ckpt verify` reports that line as the
checkpoint's problem (exit 1); a resume refuses it before any library's loader sees it. Real checkpoints of each
format still open (the allow-lists are exact: this also fails if torch's DCP starts to pickle a class they lack)."""

import json
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from test_fuzz_verbs import _assert_refused, _run

from helpers import tiny_llama_config
from toolkit.checkpoint.safe_load import check_checkpoint, read_dcp_metadata
from toolkit.cli.main import main
from toolkit.errors import UserInputError


class Payload:
    """What an attacker pickles: unpickling it calls exec, which creates `mark`."""

    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        return exec, (f"open({str(self.mark)!r}, 'w').close()",)


def _crafted_pickle(path: Path, mark: Path) -> None:
    """A protocol-2 pickle (as torch's DCP writes .metadata): it passes the 'starts as a pickle' check."""
    path.write_bytes(pickle.dumps(Payload(mark), protocol=2))


def _hostile(capsys, argv: list[str], mark: Path, file: Path) -> None:
    """A verb that opens the checkpoint refuses it: exit 2, one line naming the file and the global; nothing ran."""
    code, err = _run(capsys, argv)
    assert not mark.exists(), f"{' '.join(argv)} ran the pickle"
    _assert_refused(code, err, str(file), "asks for builtins.exec", "refused without running it")
    assert len(err) == 1, err


def _verify_finds(capsys, argv: list[str], mark: Path, file: Path) -> None:
    """`dmt ckpt verify` reports the refused pickle as the checkpoint's problem (exit 1), naming file and global."""
    code = main(argv)
    out = capsys.readouterr()
    assert not mark.exists(), f"{' '.join(argv)} ran the pickle"
    assert code == 1 and not out.err.strip(), (code, out.err)
    assert any(str(file) in line and "asks for builtins.exec" in line and "refused without running it" in line
               for line in out.out.splitlines()), out.out


def _dcp(directory: Path, state: dict) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process saves: DCP's "assuming a single process" is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return directory


@pytest.fixture
def fsdp_checkpoint(tmp_path) -> Path:
    """An HF Trainer checkpoint as Accelerate saves FSDP2 (SHARDED_STATE_DICT): checkpoint-N/pytorch_model_fsdp_0/
    (torch DCP) with the model's config.json and trainer_state.json beside it."""
    ckpt = tmp_path / "checkpoint-2"
    _dcp(ckpt / "pytorch_model_fsdp_0", {"model": {"lm_head.weight": torch.ones(8, 4), "norm.weight": torch.ones(4)}})
    (ckpt / "config.json").write_text(json.dumps(tiny_llama_config()))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    return ckpt


def test_a_real_dcp_checkpoint_opens_through_the_allow_list(fsdp_checkpoint, tmp_path):
    """What torch's DCP writes (tensors of several dtypes, stored objects, StorageMeta) unpickles with the DCP
    allow-list: a torch that pickles another class into .metadata fails here, not on a user's checkpoint."""
    plain = _dcp(tmp_path / "dcp", {"w": torch.ones(2, 3, dtype=torch.bfloat16), "step": 5,
                                    "extra": {"betas": (0.9, 0.99), "rng": torch.get_rng_state()}})
    metadata = read_dcp_metadata(plain)
    assert set(metadata.state_dict_metadata) >= {"w", "step", "extra.betas", "extra.rng"}
    check_checkpoint(plain, None)
    check_checkpoint(fsdp_checkpoint, None)
    assert main(["ckpt", "verify", str(plain), "--deep"]) == 0
    assert main(["ckpt", "verify", str(fsdp_checkpoint), "--deep"]) == 0


OPENERS = {"ckpt inspect": ["ckpt", "inspect", "{ckpt}"], "ckpt verify": ["ckpt", "verify", "{ckpt}"],
           "ckpt verify --deep": ["ckpt", "verify", "{ckpt}", "--deep"]}


@pytest.mark.parametrize("verb", [*OPENERS, "ckpt verify --deep DCP_DIR", "convert fsdp-to-hf"])
def test_a_crafted_dcp_metadata_runs_nothing(fsdp_checkpoint, tmp_path, capsys, verb):
    mark = tmp_path / "MARK"
    dcp_dir = fsdp_checkpoint / "pytorch_model_fsdp_0"
    _crafted_pickle(dcp_dir / ".metadata", mark)
    argv = {**OPENERS, "ckpt verify --deep DCP_DIR": ["ckpt", "verify", "{dcp}", "--deep"],
            "convert fsdp-to-hf": ["convert", "fsdp-to-hf", "{ckpt}", "{out}"]}[verb]
    argv = [a.format(ckpt=fsdp_checkpoint, dcp=dcp_dir, out=tmp_path / "hf") for a in argv]
    (_verify_finds if "verify" in verb else _hostile)(capsys, argv, mark, dcp_dir / ".metadata")
    assert not (tmp_path / "hf").exists()


def test_a_crafted_object_stored_in_a_dcp_checkpoint_runs_nothing(tmp_path, capsys):
    """DCP stores non-tensor values as torch.save archives inside its .distcp files, which torch's own loader
    (DefaultLoadPlanner.load_bytes, under Accelerate's FSDP resume and Megatron-Core's load) unpickles with
    weights_only=False: verify finds it, and a resume from it is refused before any library loads it."""
    mark = tmp_path / "MARK"
    ckpt = _dcp(tmp_path / "dcp", {"w": torch.ones(4), "extra": Payload(mark)})
    for argv in (["ckpt", "verify", str(ckpt)], ["ckpt", "verify", str(ckpt), "--deep"]):
        _verify_finds(capsys, argv, mark, ckpt / "__0_0.distcp")
    with pytest.raises(UserInputError, match="asks for builtins.exec"):
        check_checkpoint(ckpt, "--resume")
    assert not mark.exists()


def _zero_checkpoint(root: Path, crafted: str, mark: Path) -> Path:
    """A DeepSpeed ZeRO-2 checkpoint as the engine saves it (root/latest -> global_step2/, one data-parallel rank:
    its optimizer-state and model-state files), with `crafted` ("optim" or "model", or neither) carrying the payload."""
    tag = root / "global_step2"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step2")
    (root / "config.json").write_text(json.dumps(tiny_llama_config()))
    optim = {"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1, "loss_scaler": None,
                                      "single_partition_of_fp32_groups": [torch.zeros(12)],
                                      "base_optimizer_state": {"state": {}, "param_groups": []}}}
    model = {"module": OrderedDict(w=torch.zeros(3, 4, dtype=torch.bfloat16)),
             "param_shapes": [OrderedDict(w=torch.Size([3, 4]))], "buffer_names": [], "ds_version": "0.19.8"}
    if crafted in ("optim", "model"):
        (optim if crafted == "optim" else model)["payload"] = Payload(mark)
    # protocol 4 names builtins as Python 3 does (protocol 2's __builtin__.exec the old indexer stood in for)
    torch.save(optim, tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", pickle_protocol=4)
    torch.save(model, tag / "mp_rank_00_model_states.pt", pickle_protocol=4)
    return root


@pytest.mark.parametrize("crafted", ["optim", "model"])
@pytest.mark.parametrize("verb", [*OPENERS, "convert zero-to-hf"])
def test_a_crafted_deepspeed_rank_file_runs_nothing(tmp_path, capsys, crafted, verb):
    mark = tmp_path / "MARK"
    ckpt = _zero_checkpoint(tmp_path / "ckpt", crafted, mark)
    file = ckpt / "global_step2" / ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" if crafted == "optim"
                                    else "mp_rank_00_model_states.pt")
    argv = {**OPENERS, "convert zero-to-hf": ["convert", "zero-to-hf", "{ckpt}", "{out}"]}[verb]
    argv = [a.format(ckpt=ckpt, out=tmp_path / "hf") for a in argv]
    (_verify_finds if "verify" in verb else _hostile)(capsys, argv, mark, file)
    assert not (tmp_path / "hf").exists()


def test_the_tiny_zero_checkpoint_without_the_payload_opens(tmp_path, capsys):
    """The layout the crafted files copy is one the verbs read: the refusals above are the payload's."""
    ckpt = _zero_checkpoint(tmp_path / "ckpt", "none", tmp_path / "MARK")
    assert main(["ckpt", "inspect", str(ckpt)]) == 0
    assert "zero_stage       2" in capsys.readouterr().out
    check_checkpoint(ckpt, None)


@pytest.fixture(scope="module")
def megatron_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny HF Llama and its Megatron-Core torch_dist checkpoint, written by `dmt convert hf-to-megatron`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("megatron")
    LlamaForCausalLM(LlamaConfig(**tiny_llama_config())).save_pretrained(root / "hf")
    assert main(["convert", "hf-to-megatron", str(root / "hf"), str(root / "mcore")]) == 0
    return root / "hf", root / "mcore"


@pytest.fixture
def megatron_copy(megatron_pair, tmp_path) -> tuple[Path, Path]:
    import shutil

    hf, mcore = megatron_pair
    return hf, Path(shutil.copytree(mcore, tmp_path / "mcore"))


MEGATRON_OPENERS = {**OPENERS, "convert megatron-to-hf": ["convert", "megatron-to-hf", "{ckpt}", "{out}"],
                    "convert check": ["convert", "check", "{hf}", "{ckpt}"]}


@pytest.mark.parametrize("verb", sorted(MEGATRON_OPENERS))
def test_a_crafted_megatron_metadata_runs_nothing(megatron_copy, tmp_path, capsys, verb):
    hf, ckpt = megatron_copy
    mark = tmp_path / "MARK"
    _crafted_pickle(ckpt / ".metadata", mark)
    argv = [a.format(ckpt=ckpt, hf=hf, out=tmp_path / "out") for a in MEGATRON_OPENERS[verb]]
    (_verify_finds if "verify" in verb else _hostile)(capsys, argv, mark, ckpt / ".metadata")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("verb", ["ckpt verify", "convert check"])
def test_a_crafted_megatron_common_pt_runs_nothing(megatron_copy, tmp_path, capsys, verb):
    """common.pt is what Megatron-Core's loader torch.loads before any tensor: `dmt convert check` hands the
    directory to that loader only after every pickle in it passed the allow-lists."""
    hf, ckpt = megatron_copy
    mark = tmp_path / "MARK"
    torch.save({"iteration": 3, "args": Payload(mark)}, ckpt / "common.pt")
    argv = [a.format(ckpt=ckpt, hf=hf) for a in MEGATRON_OPENERS[verb]]
    (_verify_finds if "verify" in verb else _hostile)(capsys, argv, mark, ckpt / "common.pt")


def test_a_real_megatron_checkpoint_still_verifies_and_converts_back(megatron_pair, tmp_path, capsys):
    hf, ckpt = megatron_pair
    check_checkpoint(ckpt, "MEGATRON_DIR")
    assert main(["ckpt", "verify", str(ckpt), "--deep"]) == 0
    assert main(["convert", "megatron-to-hf", str(ckpt), str(tmp_path / "back")]) == 0
    assert "sound" in capsys.readouterr().out


def test_a_resume_from_a_crafted_checkpoint_is_refused_before_any_loader(tmp_path):
    """`--resume PATH` (dmt train, restore-test's resumed run) hands the checkpoint to DeepSpeed's engine, Accelerate's
    DCP load or ds_to_universal, all of which unpickle without restriction: the toolkit refuses it first."""
    from toolkit.backends.resume import resume_checkpoint
    from toolkit.checkpoint.manifest import write_manifest

    mark = tmp_path / "MARK"
    ckpt = _zero_checkpoint(tmp_path / "run" / "checkpoint-2", "model", mark)
    identity = {"seed": 1}
    write_manifest(ckpt, step=2, world_size=1, layout={}, fmt="deepspeed-zero", extra={"run": identity})
    with pytest.raises(UserInputError) as refused:
        resume_checkpoint(tmp_path / "run", str(ckpt), identity)
    assert refused.value.key == "--resume" and "asks for builtins.exec" in refused.value.message
    assert not mark.exists()


def _zip_records(records: list[tuple[str, bytes]]) -> bytes:
    import io
    import warnings
    import zipfile

    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        warnings.simplefilter("ignore")  # a name written twice is what one case crafts
        for name, data in records:
            archive.writestr(name, data)
    return buffer.getvalue()


@pytest.mark.parametrize("shape", ["pickle before the zip", "two folders", "a name twice"])
def test_a_rank_file_whose_zip_is_not_what_torch_load_reads_runs_nothing(tmp_path, capsys, shape):
    """Three files whose zip the index would scan harmlessly while torch.load unpickles the payload: a legacy pickle
    with a harmless torch.save zip appended (torch.load reads anything not starting with a zip record as a legacy
    pickle), a zip whose first record names another folder than the first data.pkl (torch names the archive after
    its first record) and a data.pkl written twice (zipfile reads the last). Each is refused by the resume check and
    by verify; torch.load of the first really runs it (what the check stands in front of)."""
    mark = tmp_path / "MARK"
    ckpt = _zero_checkpoint(tmp_path / "ckpt", "none", mark)
    file = ckpt / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    payload, harmless = pickle.dumps(Payload(mark), protocol=2), pickle.dumps({"a": 1}, protocol=2)
    tail = [("archive/version", b"3\n"), ("archive/byteorder", b"little")]
    file.write_bytes({
        "pickle before the zip": payload + _zip_records([("archive/data.pkl", harmless), *tail]),
        "two folders": _zip_records([("evil/version", b"3\n"), ("archive/data.pkl", harmless),
                                     ("evil/data.pkl", payload), ("evil/byteorder", b"little")]),
        "a name twice": _zip_records([("archive/data.pkl", payload), ("archive/data.pkl", harmless), *tail]),
    }[shape])
    with pytest.raises(UserInputError, match="bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        check_checkpoint(ckpt, "--resume")
    assert main(["ckpt", "verify", str(ckpt)]) == 1 and str(file) in capsys.readouterr().out
    assert not mark.exists()
    if shape == "pickle before the zip":
        with pytest.raises(RuntimeError, match="magic number"):  # after the payload, its first object, ran
            torch.load(file, weights_only=False)
        assert mark.exists()


def test_a_ranks_own_dcp_metadata_is_read_through_the_allow_list(fsdp_checkpoint, tmp_path, capsys):
    """torch's DCP loader falls back to a rank's `__<rank>.metadata` (plain pickle.load) when `.metadata` is missing:
    a crafted one beside the checkpoint's files is refused by the resume check and by verify, unrun."""
    mark = tmp_path / "MARK"
    dcp_dir = fsdp_checkpoint / "pytorch_model_fsdp_0"
    (dcp_dir / ".metadata").unlink()
    _crafted_pickle(dcp_dir / "__0.metadata", mark)
    with pytest.raises(UserInputError, match="asks for builtins.exec"):
        check_checkpoint(fsdp_checkpoint, "--resume")
    _verify_finds(capsys, ["ckpt", "verify", str(fsdp_checkpoint)], mark, dcp_dir / "__0.metadata")


def test_a_symlinked_folder_of_a_hub_snapshot_must_stay_inside_the_snapshot(fsdp_checkpoint, tmp_path):
    """The hub's cache links a snapshot's files into its repository's blobs/, never a folder: a folder linked out of
    the snapshot (even into the same repository) is refused, as the walks that scan the pickles do not enter it."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "elsewhere").mkdir()
    (repo / "blobs").mkdir()  # what makes it the hub's cache (readers.link_root)
    mark = tmp_path / "MARK"
    _dcp(repo / "elsewhere" / "dcp", {"w": torch.ones(2)})
    _crafted_pickle(repo / "elsewhere" / "dcp" / ".metadata", mark)
    (snapshot / "config.json").write_text(json.dumps(tiny_llama_config()))
    (snapshot / "pytorch_model_fsdp_0").symlink_to(repo / "elsewhere" / "dcp", target_is_directory=True)
    with pytest.raises(UserInputError, match="outside"):
        check_checkpoint(snapshot, "--resume")
    assert not mark.exists()
