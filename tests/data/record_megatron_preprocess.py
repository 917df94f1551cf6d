"""Record Megatron-LM's own tools/preprocess_data.py (at core_v0.16.1, the tag of the pinned megatron-core) on a fixed
corpus, as the golden files `dmt data prepare` must equal byte for byte (tests/data/test_data_prepare.py).

The corpus (golden/corpus.jsonl, written here) holds what breaks preprocessors: empty documents, non-ASCII text raw
and as JSON escapes (a surrogate pair among them), U+2028 and U+0085 inside a line (line ends for str.splitlines, not
for a file read in text mode), escaped control characters, the tokenizer's own end-of-text marker as plain text,
whitespace only, a list of sentences, a line ending in \\r\\n, a last line without its newline, and a very long
document. The tokenizer is tests/data/tokenizer (a byte-level BPE of 512 tokens trained on the tiny corpus, so
uint16 tokens). Each key is recorded alone, with and without --append-eod: at that tag a run with several
--json-keys writes every .bin but finalizes only the last key's .idx (its finalize sits after the loop over keys),
which the two-key runs here check once more and keep no file of.

  git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
  pip install --target /tmp/six six      # megatron.training's tokenizer package imports it; the toolkit does not
  PYTHONPATH=/tmp/six .venv/bin/python tests/data/record_megatron_preprocess.py Megatron-LM

The script runs against the installed megatron-core (the checkout's own megatron/core is put after it on the path),
with the one Triton-only import stood in for as tests/megatron/record_megatron_lm_flags.py does.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
TOKENIZER = HERE / "tokenizer"
CORPUS = GOLDEN / "corpus.jsonl"
KEYS = ("text", "title")
TAG = "core_v0.16.1"


def corpus_lines() -> list[str]:
    """The corpus, a JSON text per line (each line's end included)."""
    tiny = (HERE.parents[1] / "recipes" / "data" / "tiny_corpus.txt").read_text().splitlines()
    unicode_text = "naïve café: 日本語のテキスト, Ελληνικά, emoji 🤗 and ß"
    records = [
        ({"text": tiny[0], "title": "first"}, False),
        ({"text": "", "title": ""}, False),  # empty in both keys
        ({"title": "raw UTF-8", "text": unicode_text}, False),  # keys in another order
        ({"text": unicode_text, "title": "escaped"}, True),  # \\u escapes, the emoji as a surrogate pair
        ({"text": "one line\u2028still the same line\u0085and this", "title": "separators"}, False),
        ({"text": "tabs\tcarriage\rreturns\r\nand\nnewlines", "title": "controls"}, True),
        ({"text": "before <|endoftext|> after", "title": "<|endoftext|>"}, False),
        ({"text": "   \n\t  ", "title": "whitespace only"}, False),
        ({"text": ["First sentence.", "", "Second sentence."], "title": "sentences", "extra": 1}, False),
        ({"text": tiny[1], "title": "crlf"}, False),
        ({"text": " ".join(tiny[2:]) [:30000], "title": "long"}, False),
        ({"text": tiny[3], "title": ""}, False),
        ({"text": tiny[4], "title": "no newline at the end"}, False),
    ]
    lines = [json.dumps(record, ensure_ascii=escaped) + "\n" for record, escaped in records]
    lines[9] = lines[9][:-1] + "\r\n"
    lines[-1] = lines[-1][:-1]
    return lines


def golden_name(key: str, append_eod: bool) -> str:
    """The dataset prefix (file name) of one recorded run's key."""
    return f"{'eod' if append_eod else 'plain'}_{key}_document"


class _Reference:
    """Megatron-LM's preprocess_data.py run as a script in this interpreter, against the installed megatron-core."""

    def __init__(self, checkout: Path):
        sys.path.insert(0, str(HERE.parent / "megatron"))
        from record_megatron_lm_flags import _StandInFinder

        sys.meta_path.insert(0, _StandInFinder())
        sys.path.append(str(checkout))  # after site-packages: the installed megatron.core comes first
        self.script = checkout / "tools" / "preprocess_data.py"

    def run(self, argv: list[str]) -> None:
        sys.argv = [str(self.script), *argv]
        runpy.run_path(str(self.script), run_name="__main__")


def reference_command(checkout: Path, argv: list[str]) -> list[str]:
    """The command line that runs the reference with `argv` (this file with --run, in a fresh interpreter)."""
    return [sys.executable, str(Path(__file__).resolve()), str(checkout), "--run", "--", *argv]


def record(checkout: Path) -> None:
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    tagged = subprocess.run(["git", "-C", str(checkout), "rev-parse", f"{TAG}^{{commit}}"], capture_output=True,
                            text=True).stdout
    if head.strip() != tagged.strip() or not head.strip():
        raise SystemExit(f"{checkout} is not checked out at {TAG}")
    GOLDEN.mkdir(exist_ok=True)
    CORPUS.write_bytes("".join(corpus_lines()).encode())
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        common = ["--input", str(CORPUS), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                  str(TOKENIZER), "--workers", "2"]
        for append_eod in (False, True):
            eod = ["--append-eod"] if append_eod else []
            for key in KEYS:
                out = scratch / f"one-{key}-{append_eod}"
                subprocess.run(reference_command(checkout, [*common, *eod, "--json-keys", key, "--output-prefix",
                                                            str(out)]), check=True)
                for suffix in (".bin", ".idx"):
                    shutil.copyfile(f"{out}_{key}_document{suffix}", GOLDEN / f"{golden_name(key, append_eod)}{suffix}")
            both = scratch / f"both-{append_eod}"
            subprocess.run(reference_command(checkout, [*common, *eod, "--json-keys", *KEYS, "--output-prefix",
                                                        str(both)]), check=True)
            for key in KEYS:  # every .bin of a two-key run is its one-key run's; only the last key has an .idx
                assert filecmp.cmp(f"{both}_{key}_document.bin", GOLDEN / f"{golden_name(key, append_eod)}.bin",
                                   shallow=False), key
            assert not Path(f"{both}_{KEYS[0]}_document.idx").exists()
            assert filecmp.cmp(f"{both}_{KEYS[-1]}_document.idx", GOLDEN / f"{golden_name(KEYS[-1], append_eod)}.idx",
                               shallow=False)
    (GOLDEN / "RECORDED.json").write_text(json.dumps({
        "reference": f"Megatron-LM tools/preprocess_data.py at {TAG} ({head.strip()})",
        "flags": "--tokenizer-type HuggingFaceTokenizer --tokenizer-model tests/data/tokenizer --workers 2, "
                 "--json-keys KEY, with and without --append-eod",
        "files": "{plain,eod}_{text,title}_document.{bin,idx}: one run per key and flag",
        "two_key_runs": "every .bin equal to the one-key run's; only the last key's .idx written",
    }, indent=1) + "\n")
    print(f"recorded {len(list(GOLDEN.iterdir()))} files in {GOLDEN}", file=sys.stderr)


def main() -> int:
    if sys.argv[2:4] == ["--run", "--"]:  # CHECKOUT --run -- ARGV: preprocess_data.py itself with ARGV
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _Reference(Path(sys.argv[1]).resolve()).run(sys.argv[4:])
        return 0
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("checkout", type=Path, help=f"a Megatron-LM checkout at {TAG}")
    record(cli.parse_args().checkout.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
