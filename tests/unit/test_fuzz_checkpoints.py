"""A checkpoint from elsewhere names files, and each name is read through one bounded, confined opener: a storage
path, a rank file or a `latest` pointer that is a FIFO, a link to /dev/zero, or leads outside the checkpoint; a
torch.save record compressed to inflate a kilobyte into a gigabyte; HF Trainer's own pickles (rng_state, scheduler,
optimizer) carrying a payload; a tokenizer that is its own code. Each is refused in one line by every verb that
reads it (`dmt ckpt verify` reports it as the checkpoint's problem, exit 1), within seconds and without growing
memory: each verb runs in a forked child under a time and an address-space limit, so a read that blocks or inflates
fails the case instead of hanging the test; nothing is written, and no payload runs."""

import json
import os
import pickle
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from test_fuzz_pickles import Payload, _zero_checkpoint, fsdp_checkpoint, megatron_copy, megatron_pair  # noqa: F401

from helpers import bounded, tiny_llama_config
from toolkit.cli.main import main

BOMB = 2**30  # what the compressed record inflates to: past FUZZ_HEADROOM with the copies a reader makes of it


def _dmt(argv: list) -> tuple[int, list[str], list[str], float]:
    return bounded(lambda: main([str(a) for a in argv]))


def _resume(ckpt: Path) -> tuple[int, list[str], list[str], float]:
    """A resume from `ckpt` (a run directory's checkpoint with its manifest): what `--resume PATH` checks before any
    library's loader sees the directory."""
    from toolkit.backends.resume import resume_checkpoint
    from toolkit.checkpoint.manifest import write_manifest

    identity = {"seed": 1}
    write_manifest(ckpt, step=2, world_size=1, layout={}, fmt="test", extra={"run": identity},
                   files={})  # no hashing: the hostile files are what the check must meet, unread
    return bounded(lambda: resume_checkpoint(ckpt.parent, str(ckpt), identity) and 0)


def _refused(result, *says: str) -> str:
    code, _, err, _ = result  # its time is bounded by the child's alarm (FUZZ_HANG_GUARD_S): a hang guard, no verdict on speed
    text = "\n".join(err)
    assert code == 2 and len(err) == 1 and "Traceback" not in text, (code, text)
    assert all(str(s) in text for s in says), (says, text)
    return text


def _reported(result, *says: str) -> str:
    """`dmt ckpt verify`'s documented answer: exit 1, the problem on stdout naming `says`, nothing on stderr."""
    code, out, err, _ = result  # bounded by the child's alarm, as _refused says
    assert code == 1 and not err, (code, err)
    line = next((line for line in out if all(str(s) in line for s in says)), None)
    assert line is not None, (says, out)
    return line


def _run_verb(verb: str, ckpt: Path, out: Path, *says: str, hf: Path | None = None) -> str:
    argv = {"ckpt verify": ["ckpt", "verify", ckpt], "ckpt verify --deep": ["ckpt", "verify", ckpt, "--deep"],
            "ckpt inspect": ["ckpt", "inspect", ckpt], "convert zero-to-hf": ["convert", "zero-to-hf", ckpt, out],
            "convert fsdp-to-hf": ["convert", "fsdp-to-hf", ckpt, out],
            "convert megatron-to-hf": ["convert", "megatron-to-hf", ckpt, out],
            "convert check": ["convert", "check", hf, ckpt]}
    if verb == "resume":
        return _refused(_resume(ckpt), "--resume", *says)
    result = _dmt(argv[verb])
    line = _reported(result, *says) if verb.startswith("ckpt verify") else _refused(result, *says)
    assert not out.exists()
    assert not [p for p in out.parent.rglob("*") if ".tmp-" in p.name]
    return line


# --- what a checkpoint names: a FIFO, /dev/zero, a way out --------------------------------------------------------

def _fifo(file: Path, outside: Path) -> str:
    file.unlink()
    os.mkfifo(file)
    return "FIFO"


def _dev_zero(file: Path, outside: Path) -> str:
    file.unlink()
    file.symlink_to("/dev/zero")
    return "character device"


def _link_outside(file: Path, outside: Path) -> str:
    shutil.move(file, outside)
    file.symlink_to(outside)
    return "outside"


POINTED = {"a FIFO": _fifo, "a link to /dev/zero": _dev_zero, "a link leading outside": _link_outside}


def _dcp_path_out(dcp_dir: Path, outside: Path) -> Path:
    """The metadata rewritten so that every chunk lies in `../<outside>` (a copy of the real file there: unconfined,
    it would read)."""
    from toolkit.checkpoint.safe_load import read_dcp_metadata

    metadata = read_dcp_metadata(dcp_dir)
    names = {info.relative_path for info in metadata.storage_data.values()}
    for name in names:
        shutil.copy(dcp_dir / name, outside.parent / f"{outside.name}-{name}")
    for info in metadata.storage_data.values():
        info.relative_path = os.path.relpath(outside.parent / f"{outside.name}-{info.relative_path}", dcp_dir)
    with open(dcp_dir / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle, protocol=2)
    return dcp_dir / ".metadata"


def _storage_pointed(dcp_dir, kind: str, outside) -> list:
    """A DCP directory's storage file made one of POINTED's kinds, or its metadata pointed out of the checkpoint with
    ../; what the refusal must name."""
    if kind == "a path with ../":
        _dcp_path_out(dcp_dir, outside)
        return ["leads outside"]
    return [dcp_dir / "__0_0.distcp", POINTED[kind](dcp_dir / "__0_0.distcp", outside)]


@pytest.mark.parametrize("kind", [*sorted(POINTED), "a path with ../"])
@pytest.mark.parametrize("verb", ["ckpt verify", "ckpt verify --deep", "ckpt inspect", "convert fsdp-to-hf",
                                  "resume"])
def test_a_dcp_storage_path_that_blocks_or_leads_out_is_refused(fsdp_checkpoint, tmp_path, verb, kind):
    says = _storage_pointed(fsdp_checkpoint / "pytorch_model_fsdp_0", kind, tmp_path / "outside")
    _run_verb(verb, fsdp_checkpoint, tmp_path / "hf", *says)


@pytest.mark.parametrize("kind", [*sorted(POINTED), "a path with ../"])
@pytest.mark.parametrize("verb", ["ckpt verify", "ckpt verify --deep", "ckpt inspect", "convert megatron-to-hf",
                                  "convert check"])
def test_a_megatron_storage_path_that_blocks_or_leads_out_is_refused(megatron_copy, tmp_path, verb, kind):
    hf, ckpt = megatron_copy
    _run_verb(verb, ckpt, tmp_path / "out", *_storage_pointed(ckpt, kind, tmp_path / "outside"), hf=hf)


ZERO_FILES = {"an optimizer rank file": "global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
              "a model-state file": "global_step2/mp_rank_00_model_states.pt"}


@pytest.mark.parametrize("kind", sorted(POINTED))
@pytest.mark.parametrize("which", sorted(ZERO_FILES))
@pytest.mark.parametrize("verb", ["ckpt verify", "ckpt verify --deep", "ckpt inspect", "convert zero-to-hf",
                                  "resume"])
def test_a_zero_rank_file_that_blocks_or_leads_out_is_refused(tmp_path, verb, which, kind):
    ckpt = _zero_checkpoint(tmp_path / "run" / "checkpoint-2", "none", tmp_path / "MARK")
    file = ckpt / ZERO_FILES[which]
    _run_verb(verb, ckpt, tmp_path / "hf", file, POINTED[kind](file, tmp_path / "outside"))


def _hf_shards(directory: Path) -> Path:
    """An HF model directory of two safetensors shards and the index that names them."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(tiny_llama_config()))
    names = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    for name, file in names.items():
        save_file({name: torch.zeros(4, 4)}, directory / file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    return directory


@pytest.mark.parametrize("kind", sorted(POINTED))
@pytest.mark.parametrize("verb", ["ckpt verify", "ckpt verify --deep", "ckpt inspect"])
def test_a_safetensors_shard_its_index_names_that_blocks_or_leads_out_is_refused(tmp_path, verb, kind):
    model = _hf_shards(tmp_path / "model")
    file = model / "model-00002-of-00002.safetensors"
    _run_verb(verb, model, tmp_path / "hf", file, POINTED[kind](file, tmp_path / "outside"))


def _hub_snapshot(tmp_path: Path) -> Path:
    """The two-shard model as the Hugging Face hub's cache lays it out: models--org--name/snapshots/<revision>/ whose
    files are links to ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--org--tiny"
    model = _hf_shards(repo / "snapshots" / "0123abc")
    (repo / "blobs").mkdir()
    for file in sorted(model.iterdir()):
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.move(file, blob)
        file.symlink_to(Path("..", "..", "blobs", blob.name))
    return model


def test_a_hub_cache_snapshot_reads_alike_in_verify_inspect_and_hf_to_megatron(tmp_path):
    """Links into the cache's own blobs/ are inside the model (readers.link_root) for every verb that reads it; the
    same snapshot with a shard linked past the repository folder is refused by each."""
    model = _hub_snapshot(tmp_path)
    for argv in (["ckpt", "verify", model], ["ckpt", "inspect", model]):
        code, out, err, _ = _dmt(argv)
        assert code == 0 and not err, (argv, out[-20:], err)
    shard = model / "model-00002-of-00002.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(shard, elsewhere)
    shard.unlink()
    shard.symlink_to(elsewhere)
    _run_verb("ckpt verify", model, tmp_path / "hf", "outside")
    _run_verb("ckpt inspect", model, tmp_path / "hf", "outside")
    out = tmp_path / "megatron"
    _refused(_dmt(["convert", "hf-to-megatron", model, out]), "outside")
    assert not out.exists()


@pytest.mark.parametrize("verb", ["ckpt verify", "ckpt inspect", "convert zero-to-hf", "resume"])
def test_a_latest_pointer_leading_out_of_the_checkpoint_is_refused(tmp_path, verb):
    """DeepSpeed's `latest` names the tag directory: `../elsewhere/global_step2` (a real one) is not followed."""
    ckpt = _zero_checkpoint(tmp_path / "run" / "checkpoint-2", "none", tmp_path / "MARK")
    shutil.move(ckpt / "global_step2", tmp_path / "global_step2")
    (ckpt / "latest").write_text("../../global_step2")
    (ckpt / "global_step2").mkdir()  # the glob that finds a layout still finds a tag directory beside `latest`
    shutil.copy(tmp_path / "global_step2" / "mp_rank_00_model_states.pt", ckpt / "global_step2")
    shutil.copy(tmp_path / "global_step2" / ZERO_FILES["an optimizer rank file"].split("/")[1], ckpt / "global_step2")
    _run_verb(verb, ckpt, tmp_path / "hf", "latest", "leads outside")


@pytest.mark.parametrize("verb", ["convert zero-to-hf", "convert fsdp-to-hf", "convert megatron-to-hf"])
def test_a_side_file_linked_outside_the_checkpoint_is_not_carried_into_the_output(request, tmp_path, verb):
    """A converter copies tokenizer.json and its kind beside the weights: one linked to a file elsewhere (a key, a
    password file) would travel into a directory that is then shared. Each converter checks its side files before
    it writes a weight (found_side_files), so the refusal comes at once and leaves nothing."""
    ckpt = {"convert zero-to-hf": lambda: _zero_checkpoint(tmp_path / "zero", "none", tmp_path / "MARK"),
            "convert fsdp-to-hf": lambda: request.getfixturevalue("fsdp_checkpoint"),
            "convert megatron-to-hf": lambda: request.getfixturevalue("megatron_copy")[1]}[verb]()
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "the checkpoint\'s"}')
    (ckpt / "tokenizer.json").symlink_to(secret)
    _run_verb(verb, ckpt, tmp_path / "hf", ckpt / "tokenizer.json", "outside")


def test_the_tiny_checkpoints_without_the_damage_open_under_every_verb(fsdp_checkpoint, tmp_path):
    """The layouts the cases damage are ones the verbs read: the refusals above are the damage's."""
    ckpt = _zero_checkpoint(tmp_path / "run" / "checkpoint-2", "none", tmp_path / "MARK")
    for argv in (["ckpt", "verify", ckpt, "--deep"], ["ckpt", "verify", fsdp_checkpoint, "--deep"],
                 ["convert", "zero-to-hf", ckpt, tmp_path / "zero-hf"],
                 ["convert", "fsdp-to-hf", fsdp_checkpoint, tmp_path / "fsdp-hf"]):
        code, out, err, _ = _dmt(argv)
        assert code == 0 and not [line for line in err if "Traceback" in line], (argv, out, err)
    code, _, err, _ = _resume(ckpt)
    assert code == 0, err


# --- compression bombs ----------------------------------------------------------------------------------------------

def _bomb(file: Path) -> None:
    """Rewrite torch.save archive `file` with its data.pkl deflated and inflating to BOMB bytes: a bytes object of
    zeros the unpickler would build (then drop) before the real object, which follows unchanged. The archive grows by
    about a megabyte; written a piece at a time, so the test itself never holds the gigabyte."""
    with zipfile.ZipFile(file) as archive:
        records = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(file, "w") as archive:
        for info, data in records:
            if not info.filename.endswith("data.pkl"):
                archive.writestr(info, data)  # stored, as torch.save wrote it
                continue
            deflated = zipfile.ZipInfo(info.filename)
            deflated.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(deflated, "w", force_zip64=True) as record:
                record.write(b"\x80\x04\x8e" + BOMB.to_bytes(8, "little"))  # PROTO 4, BINBYTES8 of BOMB bytes
                zeros = bytes(2**24)
                for _ in range(BOMB // len(zeros)):
                    record.write(zeros)
                record.write(b"0" + data[2:])  # POP, then the real pickle after its own PROTO


@pytest.fixture(scope="module")
def bombed_zero(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bomb")
    ckpt = _zero_checkpoint(root / "run" / "checkpoint-2", "none", root / "MARK")
    _bomb(ckpt / ZERO_FILES["an optimizer rank file"])
    return ckpt


@pytest.mark.parametrize("verb", ["ckpt verify", "ckpt verify --deep", "ckpt inspect", "convert zero-to-hf",
                                  "resume"])
def test_a_compressed_record_that_inflates_to_a_gigabyte_is_refused_unread(bombed_zero, tmp_path, verb):
    ckpt = Path(shutil.copytree(bombed_zero, tmp_path / "run" / "checkpoint-2"))
    file = ckpt / ZERO_FILES["an optimizer rank file"]
    assert file.stat().st_size < 16 * 2**20 < BOMB
    _run_verb(verb, ckpt, tmp_path / "hf", file, "compressed record", "refused unread")


def test_a_compressed_chunk_is_refused_before_torch_inflates_it(bombed_zero, tmp_path):
    """A DCP chunk or stored object is loaded by torch.load itself (safe_load.torch_load), whose zip reader inflates a
    record whole: the same check refuses it first."""
    from toolkit.checkpoint.safe_load import torch_load

    file = bombed_zero / ZERO_FILES["an optimizer rank file"]

    def load() -> int:
        with open(file, "rb") as handle:
            torch_load(handle, file, "CKPT")
        return 0

    _refused(bounded(load), "CKPT", file, "compressed record", "refused unread")


# --- HF Trainer's own pickles ---------------------------------------------------------------------------------------

def _trainer_checkpoint(ckpt: Path, crafted: str | None, mark: Path) -> Path:
    """An HF Trainer checkpoint-N as its _save_checkpoint writes one without DeepSpeed or FSDP: weights as
    safetensors, trainer_state.json, and its own torch.save files with what they really hold (numpy's and torch's RNG
    states, a LambdaLR's state, AdamW's); `crafted` names the file that also carries the payload."""
    import random

    import numpy as np
    from safetensors.torch import save_file

    ckpt.mkdir(parents=True)
    weight = torch.nn.Parameter(torch.ones(4, 4))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_file({"w": weight.detach()}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps(tiny_llama_config()))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
    files = {"rng_state.pth": {"python": random.getstate(), "numpy": np.random.get_state(),
                               "cpu": torch.random.get_rng_state()},
             "scheduler.pt": scheduler.state_dict(), "optimizer.pt": optimizer.state_dict()}
    for name, value in files.items():
        if name == crafted:
            value["payload"] = Payload(mark)
        torch.save(value, ckpt / name)
    return ckpt


@pytest.mark.parametrize("crafted", ["rng_state.pth", "scheduler.pt", "optimizer.pt"])
@pytest.mark.parametrize("verb", ["ckpt verify", "ckpt verify --deep", "resume"])
def test_a_crafted_hf_trainer_state_file_runs_nothing(tmp_path, verb, crafted):
    mark = tmp_path / "MARK"
    ckpt = _trainer_checkpoint(tmp_path / "run" / "checkpoint-2", crafted, mark)
    _run_verb(verb, ckpt, tmp_path / "hf", ckpt / crafted, "asks for builtins.exec", "refused without running it")
    assert not mark.exists()


@pytest.mark.parametrize("verb", ["ckpt verify", "resume"])
def test_a_compressed_hf_trainer_state_file_is_refused_unread(tmp_path, verb):
    """transformers' resume torch.loads rng_state.pth whole: a deflated one inflating to a gigabyte is refused by the
    pre-check before it."""
    ckpt = _trainer_checkpoint(tmp_path / "run" / "checkpoint-2", None, tmp_path / "MARK")
    _bomb(ckpt / "rng_state.pth")
    _run_verb(verb, ckpt, tmp_path / "hf", ckpt / "rng_state.pth", "compressed record", "refused unread")


def test_a_real_hf_trainer_checkpoint_passes_the_allow_list(tmp_path):
    """What the Trainer really saves opens through the allow-list: a transformers or numpy that pickles another
    class into its RNG state fails here, not on a user's resume."""
    ckpt = _trainer_checkpoint(tmp_path / "run" / "checkpoint-2", None, tmp_path / "MARK")
    code, out, err, _ = _dmt(["ckpt", "verify", ckpt, "--deep"])
    assert code == 0 and not err, (out, err)
    code, _, err, _ = _resume(ckpt)
    assert code == 0, err


# --- a tokenizer that is its own code -------------------------------------------------------------------------------

def test_a_tokenizer_that_needs_its_own_code_is_refused_without_a_question(tmp_path):
    """transformers asks "run the custom code? [y/N]" (on every rank) for a tokenizer_config.json with an auto_map;
    the toolkit answers no itself, in one line naming the recipe key, and the code never runs."""
    from test_fuzz_verbs import RECIPE_TEXT
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from toolkit.backends.data import build_tokenizer
    from toolkit.spec.recipe import load_recipe

    directory, mark = tmp_path / "tok", tmp_path / "MARK"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": [None, "tokenization_own.OwnTokenizer"]}, tokenizer_class="OwnTokenizer")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "tokenization_own.py").write_text(
        f"open({str(mark)!r}, 'w').close()\nfrom transformers import PreTrainedTokenizerFast as OwnTokenizer\n")
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(RECIPE_TEXT.replace("  tokenizer:\n", f"  tokenizer:\n    path: {directory}\n", 1))
    recipe = load_recipe(recipe_path)
    assert recipe.data.tokenizer.path

    def load() -> int:
        sys.stdin = open(os.devnull)  # a question would read here: none may be asked
        build_tokenizer(recipe, None)
        return 0

    _refused(bounded(load), "data.tokenizer.path", directory, "its own Python code")
    assert not mark.exists()


def _broken_tokenizer(directory: Path, outside: Path, kind: str) -> None:
    """A tokenizer directory whose tokenizer.json is `kind`: a FIFO (a load would wait for a writer for ever), a
    directory, missing, not JSON, JSON of another shape, or a link to a file outside the directory."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")),
                            unk_token="<unk>").save_pretrained(directory)
    planted = directory / "tokenizer.json"
    outside.write_bytes(planted.read_bytes())  # a sound tokenizer, but another directory's
    planted.unlink()
    if kind == "fifo":
        os.mkfifo(planted)
    elif kind == "directory":
        planted.mkdir()
    elif kind == "garbage":
        planted.write_bytes(b"\x00\xffnot a tokenizer")
    elif kind == "wrong shape":
        planted.write_text('{"version": "1.0", "model": 5}')
    elif kind == "outside":
        planted.symlink_to(outside)


BROKEN_TOKENIZERS = {"fifo": "is a FIFO (named pipe), not a regular file", "directory": "is a directory",
                     "missing": "holds no tokenizer transformers can load",
                     "garbage": "holds no tokenizer transformers can load",
                     "wrong shape": "holds no tokenizer transformers can load", "outside": "outside"}


@pytest.mark.parametrize("kind", BROKEN_TOKENIZERS)
def test_a_tokenizer_that_blocks_leads_outside_or_does_not_load_is_refused_in_one_line(tmp_path, kind):
    """Training's tokenizer (data.tokenizer.path: build_tokenizer, as the HF and Megatron backends load it) and `dmt
    data prepare --tokenizer` (Megatron-Core's HuggingFaceTokenizer) over a broken tokenizer.json: one line naming
    the key or flag and what would be valid, within the child's alarm (a FIFO opened for reading would block)."""
    from test_fuzz_verbs import RECIPE_TEXT

    from toolkit.backends.data import build_tokenizer
    from toolkit.spec.recipe import load_recipe

    directory = tmp_path / "tok"
    _broken_tokenizer(directory, tmp_path / "elsewhere.json", kind)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(RECIPE_TEXT.replace("  tokenizer:\n", f"  tokenizer:\n    path: {directory}\n", 1))
    recipe = load_recipe(recipe_path)
    line = _refused(bounded(lambda: build_tokenizer(recipe, None) and 0), "data.tokenizer.path", directory,
                    BROKEN_TOKENIZERS[kind])
    assert "Hugging Face tokenizer directory" in line, line
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n')
    _refused(_dmt(["data", "prepare", "--input", corpus, "--tokenizer", directory, "--output-prefix",
                   tmp_path / "out"]), "--tokenizer", directory, BROKEN_TOKENIZERS[kind])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "elsewhere.json", "recipe.yaml", "tok"]


def test_a_universal_copy_is_reused_only_for_the_checkpoint_it_was_made_from(tmp_path, gloo_group_of_one,
                                                                               monkeypatch):
    """OUTPUT/universal/<name> made from one checkpoint-4 is not resumed from for another checkpoint-4 (an output
    directory reused for another run): its universal_source.json no longer matches, and it is made again."""
    from toolkit.backends.deepspeed import universal

    made = []

    def convert(ckpt, target):  # the conversion itself runs for real in tests/checkpoint/test_restore.py
        target.mkdir(parents=True, exist_ok=True)
        (target / universal.MARKER).write_text("global_step4_universal")
        (target / universal.SOURCE).write_text(json.dumps(universal._source(ckpt)))
        made.append(ckpt)

    monkeypatch.setattr(universal, "_convert", convert)
    ckpt, out = tmp_path / "run" / "checkpoint-4", tmp_path / "run"
    (ckpt / "global_step4").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step4")
    (ckpt / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"first run")
    target = universal.universal_checkpoint(ckpt, out)
    assert universal.universal_checkpoint(ckpt, out) == target and len(made) == 1  # the same checkpoint: reused
    (ckpt / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"another run's weights")
    universal.universal_checkpoint(ckpt, out)
    assert len(made) == 2  # another checkpoint of the same name: made again
    (target / universal.SOURCE).unlink()  # a copy from before universal_source.json: made again
    universal.universal_checkpoint(ckpt, out)
    assert len(made) == 3
