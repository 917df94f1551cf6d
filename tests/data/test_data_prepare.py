"""`dmt data prepare` against Megatron-LM's own preprocess_data.py (golden files recorded by
record_megatron_preprocess.py at core_v0.16.1), and what a user checks: the sidecar's counts, every input format
giving the same bytes, bad lines refused in one line with nothing left behind, `dmt data inspect` reading it back."""

import filecmp
import gzip
import importlib.util
import json
import random
from pathlib import Path

import pytest

from toolkit.cli.main import main

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
TOKENIZER = HERE / "tokenizer"
CORPUS = GOLDEN / "corpus.jsonl"


def _prepare(capsys, inputs, prefix, *flags) -> dict:
    code = main(["data", "prepare", "--input", *map(str, inputs), "--tokenizer", str(TOKENIZER), "--output-prefix",
                 str(prefix), "--workers", "2", "--json", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _same_files(prefix_a, prefix_b, key_a: str, key_b: str) -> bool:
    return all(filecmp.cmp(f"{prefix_a}_{key_a}_document{s}", f"{prefix_b}_{key_b}_document{s}", shallow=False)
               for s in (".bin", ".idx"))


@pytest.mark.parametrize("append_eod", [False, True], ids=["plain", "append-eod"])
def test_two_keys_equal_megatron_lms_one_key_runs_byte_for_byte(tmp_path, capsys, append_eod):
    """Empty, non-ASCII (raw and escaped), separator-laden, list-of-sentences and long documents, two keys: each
    key's .bin and .idx are the reference's, and (unlike the reference at that tag) both indexes are written."""
    flags = ["--json-keys", "text", "title"] + (["--append-eod"] if append_eod else [])
    record = _prepare(capsys, [CORPUS], tmp_path / "corpus", *flags)
    for key in ("text", "title"):
        assert _same_files(tmp_path / "corpus", GOLDEN / ("eod" if append_eod else "plain"), key, key)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"corpus_{k}_document.{s}" for k in ("text", "title") for s in ("bin", "idx")] + ["corpus.dmt.json"])
    assert json.loads((tmp_path / "corpus.dmt.json").read_text())["datasets"] == record["datasets"]


def test_blocks_cut_inside_a_long_document_and_gzip_give_the_same_bytes(tmp_path):
    """Blocks of 1 KiB (the long document spans thirty of them; one line ends in \\r\\n) from a gzipped copy, one
    worker: the same files as the reference."""
    from toolkit.data.prepare import prepare

    compressed = tmp_path / "corpus.jsonl.gz"
    compressed.write_bytes(gzip.compress(CORPUS.read_bytes()))
    done = prepare([compressed], TOKENIZER, tmp_path / "small", ["text"], True, 1, block_bytes=1024)
    assert _same_files(tmp_path / "small", GOLDEN / "eod", "text", "text")
    assert done.documents == 13


def test_the_sidecar_names_the_tokenizer_inputs_and_counts_as_the_index_holds_them(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    record = _prepare(capsys, [CORPUS], tmp_path / "c", "--append-eod")
    entry = record["datasets"]["text"]
    dataset = IndexedDataset(str(tmp_path / entry["prefix"]))
    assert entry["documents"] == len(dataset.document_indices) - 1 == 13
    assert entry["sequences"] == len(dataset) and entry["tokens"] == int(dataset.sequence_lengths.sum())
    assert entry["max_token_id"] == max(int(dataset[i].max()) for i in range(len(dataset))) < 512
    assert record["tokenizer"]["vocab_size"] == 512 and record["dtype"] == "uint16" and record["append_eod"]
    assert set(record["tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert record["inputs"] == [{"path": str(CORPUS), "bytes": CORPUS.stat().st_size, "format": "jsonl"}]
    assert record["throughput"]["workers"] == 2


def test_parquet_and_text_inputs_give_the_bytes_of_the_same_documents_as_json_lines(tmp_path, capsys):
    import pyarrow
    import pyarrow.parquet

    lines = (HERE.parents[1] / "recipes" / "data" / "tiny_corpus.txt").read_text().splitlines()[:40] + ["", "é 🤗"]
    rows = [{"text": line, "title": f"t{i}"} for i, line in enumerate(lines)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=7)
    (tmp_path / "rows.txt").write_text("\n".join(lines) + "\n")
    _prepare(capsys, [tmp_path / "rows.jsonl"], tmp_path / "json", "--json-keys", "text", "title")
    _prepare(capsys, [tmp_path / "rows.parquet"], tmp_path / "parquet", "--json-keys", "text", "title")
    _prepare(capsys, [tmp_path / "rows.txt"], tmp_path / "plain")
    assert _same_files(tmp_path / "json", tmp_path / "parquet", "text", "text")
    assert _same_files(tmp_path / "json", tmp_path / "parquet", "title", "title")
    assert _same_files(tmp_path / "json", tmp_path / "plain", "text", "text")


def test_several_inputs_are_one_dataset_in_their_order(tmp_path, capsys):
    lines = CORPUS.read_bytes().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_bytes(b"".join(lines[:5]))
    (tmp_path / "b.jsonl").write_bytes(b"".join(lines[5:]))
    _prepare(capsys, [tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "ab")
    assert _same_files(tmp_path / "ab", GOLDEN / "plain", "text", "text")


def _random_text(rng: random.Random) -> str:
    alphabet = "abc XYZ.,!?\t\n\r-'\"éß日本🤗\u2028\u0085<|endoftext|>"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))


def _wordpiece_tokenizer(directory: Path) -> Path:
    """A WordPiece tokenizer with a lowercasing normaliser and an unknown token: unlike the byte-level BPE, some
    characters become [UNK], and its tokens are not bytes."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = (HERE.parents[1] / "recipes" / "data" / "tiny_corpus.txt").read_text().splitlines()
    tokenizer.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[SEP]").save_pretrained(directory)
    return directory


def test_the_batch_encoder_gives_the_ids_megatrons_tokenize_gives(tmp_path):
    """The reference calls Megatron-Core's tokenizer (built by its build_tokenizer) once per text: the batch encoder
    gives the same ids on random text, for the byte-level BPE and for a WordPiece with [UNK]."""
    from types import SimpleNamespace

    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    from toolkit.data.tokenizer import BatchEncoder, load_tokenizer

    rng = random.Random(0)
    texts = [_random_text(rng) for _ in range(300)]
    for directory in (TOKENIZER, _wordpiece_tokenizer(tmp_path / "wordpiece")):
        reference = build_tokenizer(SimpleNamespace(  # preprocess_data.py's arguments at their defaults
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(directory), vocab_file=None, merge_file=None,
            tokenizer_special_tokens=None, tokenizer_hf_use_fast=False, trust_remote_code=False,
            tokenizer_hf_include_special_tokens=False, tokenizer_metadata=None))
        expected = [reference.tokenize(text) for text in texts]
        ours, rust_only = BatchEncoder(load_tokenizer(directory)), BatchEncoder(load_tokenizer(directory))
        rust_only.fast = None  # tokenizers' batch call, whether gigatoken stands in for it or not
        for encoder in (ours, rust_only):
            assert [list(ids) for ids in encoder.encode(texts)] == expected, encoder.name
        assert ours.tokenizer.eod == reference.eod and ours.tokenizer.vocab_size == reference.vocab_size
        if directory == TOKENIZER and importlib.util.find_spec("gigatoken"):
            assert ours.name.startswith("gigatoken")  # where installed, it passes the probe for this BPE


BAD_LINES = {  # a line replaced -> what the one line says
    "not json": ('{"text": "unclosed', "line 3 is not a JSON object"),
    "blank": ("", "line 3 is not a JSON object"),
    "a list": ("[1, 2]", "line 3 holds a JSON list"),
    "no such key": ('{"body": "x"}', "line 3 has no key 'text'"),
    "a number": ('{"text": 7}', "line 3 has int under 'text'"),
    "null": ('{"text": null}', "line 3 has null under 'text'"),
    "lone surrogate": ('{"text": "a \\ud800 b"}', "line 3 holds '\\ud800'"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_is_one_line_naming_file_and_line_and_nothing_is_left(tmp_path, capsys, case):
    line, says = BAD_LINES[case]
    lines = CORPUS.read_bytes().split(b"\n")  # not splitlines: the corpus holds U+2028 and U+0085 inside lines
    lines[2] = line.encode()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"\n".join(lines))
    code = main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(TOKENIZER), "--output-prefix",
                 str(tmp_path / "out"), "--workers", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{corpus} {says}" in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]


def _slowed(monkeypatch, prepare_module, seconds: float, unless: bytes = b"\0"):
    """The workers' encoding slowed down by `seconds` a block (but for blocks holding `unless`), so that a test surely
    stops or kills them while they hold blocks. Set before the workers fork: they inherit it."""
    import time

    encode = prepare_module._encode_chunk

    def slow(chunk):
        if unless not in chunk.payload:
            time.sleep(seconds)  # keeps blocks in flight at the stop; the verdicts are on what the run leaves
        return encode(chunk)

    monkeypatch.setattr(prepare_module, "_encode_chunk", slow)


def test_a_run_stopped_early_lets_its_workers_finish_instead_of_killing_them(tmp_path, monkeypatch):
    """A bad line in the first of many blocks stops the run while the workers still encode later blocks (slowed down
    here, so that they surely are). Ending multiprocessing.Pool with terminate() SIGTERMed them, and one killed
    between sending its result and releasing the result queue's lock left terminate() waiting on that lock forever
    (about one early stop in 300 on a 2-core machine: a CI run hung in the bad-line test above). The workers must
    finish their blocks and exit by themselves, exit code 0."""
    import toolkit.data.prepare as prepare_module
    from toolkit.errors import UserInputError

    _slowed(monkeypatch, prepare_module, 0.5, unless=b'{"text": 7}')
    ended = []
    close = prepare_module._Workers.close

    def recording_close(pool):
        close(pool)
        ended.append(pool.exitcodes)

    monkeypatch.setattr(prepare_module._Workers, "close", recording_close)
    lines = CORPUS.read_bytes().split(b"\n")
    lines[1] = b'{"text": 7}'
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b"\n".join(lines * 4))
    with pytest.raises(UserInputError, match="line 2 has int under 'text'"):
        prepare_module.prepare([corpus], TOKENIZER, tmp_path / "out", ["text"], False, 2, block_bytes=4096)
    assert ended == [[0, 0]]
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]


def test_a_worker_killed_from_outside_ends_the_run_in_one_line(tmp_path, monkeypatch):
    """SIGKILL to a worker while it encodes (the out-of-memory killer's signal): multiprocessing.Pool replaced the
    worker and the main process waited for its block for ever. Now the run ends at once with one line naming
    --workers and the signal, the other worker exits, and nothing is left. The block it held is slowed down to 30 s
    so that it surely dies holding it; the run must end long before that block would have come back. The run is a
    forked child under the fuzz files' hang guard (helpers.bounded: killed after FUZZ_HANG_GUARD_S = 120 s, four
    times the slowed block), so a run that waits for the dead worker again fails the case instead of hanging CI."""
    import os
    import signal
    import threading
    import time

    import toolkit.data.prepare as prepare_module
    from helpers import bounded
    from toolkit.errors import UserInputError

    _slowed(monkeypatch, prepare_module, 30.0)
    started = []
    init = prepare_module._Workers.__init__

    def recording_init(pool, count):
        init(pool, count)
        started.append(pool)

    monkeypatch.setattr(prepare_module._Workers, "__init__", recording_init)

    def kill_the_first_worker():
        while not started:
            time.sleep(0.01)
        os.kill(started[0].workers[0][0].pid, signal.SIGKILL)

    def run() -> int:  # in the forked child: the killer thread starts there, where the workers are
        killer = threading.Thread(target=kill_the_first_worker, daemon=True)
        killer.start()
        began = time.monotonic()
        with pytest.raises(UserInputError, match="was killed by signal 9") as refused:
            prepare_module.prepare([CORPUS], TOKENIZER, tmp_path / "out", ["text"], False, 2, block_bytes=4096)
        # the other worker, holding 30 s blocks, is killed by the end of the run, not waited for (END_WAIT_S is 60 s)
        assert refused.value.key == "--workers" and "\n" not in str(refused.value)
        assert time.monotonic() - began < 30, "the run waited for a block of the killed worker or of its sibling"
        assert not any(process.is_alive() for process, _, _ in started[0].workers)
        return 0

    code, _, err, _ = bounded(run)
    assert code == 0, "\n".join(err)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_invalid_utf8_names_its_line(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    code = main(["data", "prepare", "--input", str(corpus), "--tokenizer", str(TOKENIZER), "--output-prefix",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and f"{corpus} line 2 is not UTF-8 (byte 0xe9)" in err, err


def test_a_second_run_replaces_the_datasets_whole(tmp_path, capsys):
    _prepare(capsys, [CORPUS], tmp_path / "c", "--append-eod")
    _prepare(capsys, [CORPUS], tmp_path / "c")
    assert _same_files(tmp_path / "c", GOLDEN / "plain", "text", "text")
    assert json.loads((tmp_path / "c.dmt.json").read_text())["append_eod"] is False
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_inspect_reads_back_counts_lengths_and_the_first_document(tmp_path, capsys):
    record = _prepare(capsys, [CORPUS], tmp_path / "c", "--json-keys", "text", "title", "--append-eod")
    assert main(["data", "inspect", str(tmp_path / "c"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    text = summary["datasets"]["text"]
    assert text["documents"] == record["datasets"]["text"]["documents"] == 13 and text["empty_documents"] == 1
    assert text["tokens"] == record["datasets"]["text"]["tokens"] and text["dtype"] == "uint16"
    first_line = json.loads(CORPUS.read_bytes().split(b"\n")[0])["text"]
    assert text["first_document"]["text"] == first_line + "<|endoftext|>"
    lengths = text["document_tokens"]
    assert lengths["min"] == 0 and lengths["max"] > 5000 > lengths["p90"] >= lengths["p50"]  # one long document
    assert summary["datasets"]["title"]["first_document"]["text"] == "first<|endoftext|>"
    # a Megatron prefix without the sidecar (Megatron-LM's own output): counted, not decoded
    assert main(["data", "inspect", str(GOLDEN / "plain_title_document")]) == 0
    out = capsys.readouterr().out
    assert "13 documents (2 empty)" in out and "not decoded: no sidecar names a tokenizer" in out


def _start_and_stop(tmp_path: Path, prefix: Path, corpus: Path, stop) -> tuple[int, str]:
    """`dmt data prepare` in its own process, `stop(process)` once its first temporary file is there."""
    import os
    import subprocess
    import sys
    import time

    process = subprocess.Popen([sys.executable, "-m", "toolkit", "data", "prepare", "--input", str(corpus),
                                "--tokenizer", str(TOKENIZER), "--output-prefix", str(prefix), "--workers", "2"],
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(HERE.parents[1])))
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f".{prefix.name}_*.tmp-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process.poll() is None, "finished before it could be stopped: a larger corpus is needed"
    stop(process)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def test_an_interrupted_run_leaves_nothing_that_looks_complete(tmp_path):
    """Ctrl-C: exit 130, one line, nothing left. SIGKILL: no dataset under its own name and no record, only hidden
    temporary files."""
    import signal

    line = CORPUS.read_bytes().split(b"\n")[10] + b"\n"  # the long document: ~30 KB a line
    corpus = tmp_path / "big.jsonl"
    corpus.write_bytes(line * 1000)
    code, err = _start_and_stop(tmp_path, tmp_path / "stopped", corpus, lambda p: p.send_signal(signal.SIGINT))
    lines = [text for text in err.splitlines() if text.strip() and "arning" not in text]
    assert code == 130 and lines[-1].startswith("dmt data: interrupted; removed the partial files"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]
    code, _ = _start_and_stop(tmp_path, tmp_path / "killed", corpus, lambda p: p.kill())
    assert code == -9
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "big.jsonl")
    assert left and all(name.startswith(".killed_") and ".tmp-" in name for name in left), left


def test_a_compressed_line_past_the_bound_is_refused_in_bounded_memory(tmp_path):
    """A 100 KB .gz holding one 100 MB JSON line cost 4.2 GB: the line is refused once LINE_BYTES_MAX of it is read,
    in one line naming the file and the line, nothing left, the whole run (its imports included, about 0.5 GB) well
    under 2 GiB: the bound is 16 MiB of text, and a worker never sees the line."""
    import os
    import subprocess
    import sys

    from toolkit.data.sources import LINE_BYTES_MAX

    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wt") as handle:
        handle.write('{"text": "fine"}\n' * 3 + json.dumps({"text": "a" * (6 * LINE_BYTES_MAX)}) + "\n")
    assert bomb.stat().st_size < LINE_BYTES_MAX // 50
    # a fresh parent measures the run alone: the largest of the command and its workers (RUSAGE_CHILDREN, KiB)
    measure = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")
    result = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "toolkit", "data", "prepare",
                             "--input", str(bomb), "--tokenizer", str(TOKENIZER), "--output-prefix",
                             str(tmp_path / "out"), "--workers", "2"],
                            capture_output=True, text=True, timeout=300, check=False,
                            env=dict(os.environ, PYTHONPATH=str(HERE.parents[1])))
    err = [line for line in result.stderr.splitlines() if line.strip() and "arning" not in line]
    assert result.returncode == 2 and len(err) == 1, result.stderr
    assert f"{bomb} line 4 is longer than 16 MiB" in err[0]
    assert int(result.stdout.split()[-1]) < 2 * 2**20  # KiB: 2 GiB
    assert [p.name for p in tmp_path.iterdir()] == ["bomb.jsonl.gz"]


@pytest.mark.parametrize("fine_rows", [3, 10_000], ids=["alone", "among-short-rows"])
def test_a_compressed_parquet_value_past_the_bound_is_refused_in_bounded_memory(tmp_path, fine_rows):
    """A parquet value of 64 MiB that zstd compresses to kilobytes: pyarrow decompresses a page whole, so the reader
    inflated it before measuring it. Its row group is now refused from the sizes the file's metadata records, before
    any page is read: by its average row past LINE_BYTES_MAX (alone) or its inflation past PARQUET_INFLATION_MAX
    (among short rows). The read runs in a forked child (helpers.bounded) whose pyarrow allocations (a pool of its
    own) stay under LINE_BYTES_MAX and whose resident memory grows by less than the value: it is never held."""
    import resource
    import sys

    import pyarrow
    import pyarrow.compute  # noqa: F401 (imported before the measure, as the reader imports it)
    import pyarrow.parquet

    from helpers import bounded
    from toolkit.data.sources import LINE_BYTES_MAX, chunks, source_of
    from toolkit.errors import UserInputError, error_line

    bomb = tmp_path / "bomb.parquet"

    def write() -> int:  # in a child of its own: the test's allocator keeps none of the 64 MiB it builds
        table = pyarrow.table({"text": ["fine"] * fine_rows + ["a" * (4 * LINE_BYTES_MAX)]})
        pyarrow.parquet.write_table(table, bomb, compression="zstd")
        return 0

    assert bounded(write)[0] == 0 and bomb.stat().st_size < LINE_BYTES_MAX // 100

    def read() -> int:
        pool = pyarrow.proxy_memory_pool(pyarrow.default_memory_pool())  # counts this read's allocations alone
        pyarrow.set_memory_pool(pool)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            list(chunks(source_of(bomb, ["text"]), ["text"]))
        except UserInputError as exc:
            print(error_line("dmt", exc), file=sys.stderr)
        print(pool.max_memory(), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
        return 2

    code, out, err, _ = bounded(read)
    allocated, grown = map(int, out[-1].split())
    assert allocated < LINE_BYTES_MAX and grown < 4 * LINE_BYTES_MAX, (allocated, grown)
    assert code == 2 and len(err) == 1 and f"--input: {bomb} row group 0" in err[0], err
    assert "refused unread" in err[0] and ("longer than the 16 MiB" if fine_rows == 3 else "inflates over") in err[0]
    assert [p.name for p in tmp_path.iterdir()] == ["bomb.parquet"]


def test_parquet_row_groups_are_read_in_batches_of_about_a_block(tmp_path):
    """Row groups of any size are read a batch of about BLOCK_BYTES at a time (at most PARQUET_ROWS rows), each row
    once and in order, by the sizes the file records."""
    import pyarrow
    import pyarrow.parquet

    from toolkit.data.sources import BLOCK_BYTES, PARQUET_ROWS, chunks, source_of

    texts = [f"{i} " + "x" * 2000 for i in range(3000)]
    path = tmp_path / "rows.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": texts}), path, row_group_size=2500, use_dictionary=False)
    read = list(chunks(source_of(path, ["text"]), ["text"]))
    assert [value for chunk in read for value in chunk.payload["text"]] == texts
    sizes = [len(chunk.payload["text"]) for chunk in read]
    assert max(sizes) < PARQUET_ROWS and max(sizes) * 2000 <= 1.1 * BLOCK_BYTES, sizes
