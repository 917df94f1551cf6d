"""The tokenizer of `dmt data prepare`, built as Megatron-LM's tools/preprocess_data.py builds it, its identity for
the sidecar, and a batch encoder that gives, document for document, the ids the reference's per-document call
gives."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import link_root, one_line, open_regular, problem

log = logging.getLogger(__name__)

# the files of a tokenizer directory transformers may read (a model directory also holds weights: not read here):
# what makes its identity (toolkit/data/tokenizer.py files_digest), and its config.json, which AutoTokenizer reads
# when tokenizer_config.json names no class
TOKENIZER_FILES = re.compile(r"(tokenizer|vocab|merges|special_tokens|added_tokens|chat_template|spiece).*"
                             r"|.*\.(model|tiktoken)", re.IGNORECASE)
TOKENIZER_DIRECTORY = "a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json, ...)"


def tokenizer_directory(directory: Path | str, key: str) -> Path:
    """`directory`, once every file of it a tokenizer library would read (TOKENIZER_FILES, config.json) is a regular
    file inside it (a symlink judged by its target; into the hub's cache's blobs for a snapshot, link_root), so that
    no FIFO blocks the load and no link reads another directory's file: one line naming `key` otherwise. Nothing is
    read; each file is opened without waiting and closed."""
    directory = Path(directory)
    if not directory.is_dir():
        raise problem(directory, key, f"is not a directory; expected {TOKENIZER_DIRECTORY}")
    root = link_root(directory)
    for entry in sorted(directory.iterdir()):
        if TOKENIZER_FILES.fullmatch(entry.name) or entry.name == "config.json":
            open_regular(entry, key, f"a file of {TOKENIZER_DIRECTORY}", root=root).close()
    return directory


def tokenizer_refused(directory: Path | str, key: str, exc: BaseException) -> UserInputError:
    """The one line for a tokenizer directory a tokenizer library could not load (`exc`: what it raised)."""
    if "trust_remote_code" in str(exc):
        return UserInputError(key, f"{directory} holds a tokenizer that is its own Python code (an auto_map in its "
                                   f"tokenizer_config.json); the toolkit never runs a checkpoint's code: use a "
                                   f"tokenizer transformers' own classes load (tokenizer.json)")
    return UserInputError(key, f"{directory} holds no tokenizer transformers can load ({type(exc).__name__}: "
                               f"{one_line(exc)[:300]}); expected {TOKENIZER_DIRECTORY} with a valid tokenizer.json")


def hf_tokenizer(directory: Path | str, key: str):
    """transformers' AutoTokenizer over a local tokenizer directory (its files checked first, tokenizer_directory),
    with trust_remote_code=False: a directory whose tokenizer is its own Python code (an `auto_map` in its
    tokenizer_config.json) is one line naming `key`, never run, and never the question "run the custom code? [y/N]"
    transformers otherwise asks (on every rank). A tokenizer it cannot load (no tokenizer.json, or one that is not
    a tokenizer) is one line naming `key` too."""
    from transformers import AutoTokenizer

    tokenizer_directory(directory, key)
    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 (tokenizers' own errors are plain Exceptions; a wrong shape a KeyError)
        raise tokenizer_refused(directory, key, exc) from None


# preprocess_data.py at core_v0.16.1 builds its tokenizer with megatron.core's build_tokenizer (the new tokenizer
# system: --legacy-tokenizer is off by default), which for HuggingFaceTokenizer passes these (its argument defaults:
# --tokenizer-hf-use-fast and --tokenizer-hf-include-special-tokens off, no --tokenizer-special-tokens, no
# --vocab-file or --merge-file)
REFERENCE_ARGUMENTS = dict(vocab_file=None, merges_file=None, additional_special_tokens=[], use_fast=False,
                           trust_remote_code=False, include_special_tokens=False)


def load_tokenizer(directory: Path, flag: str = "--tokenizer"):
    """Megatron-Core's HuggingFaceTokenizer over the tokenizer in `directory`, with the reference's arguments: the
    object whose `tokenize`, `eod` and `vocab_size` preprocess_data.py uses."""
    directory = tokenizer_directory(directory, flag)  # regular files inside it only: nothing blocks or reads elsewhere
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer

    try:
        return HuggingFaceTokenizer(str(directory), **REFERENCE_ARGUMENTS)
    except Exception as exc:  # noqa: BLE001 (tokenizers' own errors are plain Exceptions; a wrong shape a KeyError)
        raise tokenizer_refused(directory, flag, exc) from None


def megatron_tokenizer(directory: Path, flag: str):
    """Megatron-Core's MegatronTokenizer over the same HF tokenizer (what GPTDatasetConfig takes: its end of document
    and the identifiers its index cache is named by), as Megatron-LM's build_tokenizer makes it."""
    from megatron.core.tokenizers import MegatronTokenizer

    load_tokenizer(directory, flag)  # a directory that does not load is one line naming the key
    return MegatronTokenizer.from_pretrained(tokenizer_path=str(directory), metadata_path={"library": "huggingface"},
                                             **REFERENCE_ARGUMENTS)


def identity(directory: Path, tokenizer) -> dict:
    """What names this tokenizer in the sidecar: its directory, vocabulary size (as the reference counts it: what
    decides the token dtype), end-of-document id, and the sha256 of each of its files and of them all."""
    directory = Path(directory).resolve()
    files, combined = files_digest(directory)
    return {"path": str(directory), "vocab_size": int(tokenizer.vocab_size), "eod": tokenizer.eod,
            "sha256": combined, "files": files}


def files_digest(directory: Path) -> tuple[dict[str, str], str]:
    """({file: sha256}, the sha256 of them all) of the files that make a tokenizer directory's identity (the
    sidecar's `tokenizer.sha256`, which a blend's training compares with its recipe's tokenizer)."""
    files = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
             for path in sorted(Path(directory).iterdir()) if path.is_file() and TOKENIZER_FILES.fullmatch(path.name)}
    return files, hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in files.items()).encode()).hexdigest()


# texts on which gigatoken must give the Rust tokenizer's ids before it stands in for it (with every added token's
# text inside, see _agreeing_gigatoken): what byte-level and SentencePiece tokenizers treat specially
PROBE = ["The cluster saves a checkpoint.", "", " ", "   leading and trailing   ", "tabs\tand\nnewlines\r\n",
         "naïve café: 日本語のテキスト, Ελληνικά, 🤗 ß", "digits 1234567890 3.14159 1e-9", "don't we'll I'M",
         "separators\u2028and\u0085here", "x" * 300, "mixed-CASE words_with_underscores and #hash @at"]


def _agreeing_gigatoken(hf, backend):
    """gigatoken's encoder of the same tokenizer (its Rust encoder of byte-level and SentencePiece BPE is several
    times faster than tokenizers' on one thread), when it is installed, loads this tokenizer and gives the Rust
    tokenizer's ids on PROBE and on every added token inside text; None otherwise (tokenizers then encodes)."""
    try:
        import gigatoken
    except ImportError:
        return None
    added = [token.content for token in backend.get_added_tokens_decoder().values()]
    probe = PROBE + [f"a{token}b {token} {token}{token}" for token in added]
    try:
        fast = gigatoken.Tokenizer(hf)
        agrees = fast.encode_batch_list(probe, parallel=False) == \
            [encoding.ids for encoding in backend.encode_batch_fast(probe, add_special_tokens=False)]
    except Exception as exc:  # noqa: BLE001 (any failure to load or encode: tokenizers encodes instead)
        log.info("gigatoken does not take this tokenizer (%s); tokenizers encodes", one_line(exc)[:200])
        return None
    if not agrees:
        log.info("gigatoken's ids differ from the tokenizer's on the probe texts; tokenizers encodes")
    return fast if agrees else None


class BatchEncoder:
    """Token ids of many texts at once, equal to the reference's `tokenizer.tokenize(text)` of each: transformers'
    tokenize runs the Rust tokenizer on one text (add_special_tokens=False, special tokens split as the tokenizer
    says) and maps each token string back to an id. The batch runs the same Rust tokenizer once over the batch (or
    gigatoken, where it is installed and agrees with it) and maps each id through the same string round trip (a
    table, built once). A tokenizer without a Rust backend is called text by text, as the reference calls it."""

    def __init__(self, tokenizer):
        import numpy

        self.tokenizer = tokenizer
        hf = tokenizer.tokenizer
        self.backend = getattr(hf, "backend_tokenizer", None)
        self.remap = self.fast = None
        if self.backend is None:
            return
        self.split_special_tokens = bool(getattr(hf, "split_special_tokens", False))
        if not self.split_special_tokens:  # gigatoken always splits special tokens out of text, as tokenizers does
            self.fast = _agreeing_gigatoken(hf, self.backend)
        size = self.backend.get_vocab_size(with_added_tokens=True)
        table = numpy.arange(size, dtype=numpy.int64)
        for token_id in range(size):
            token = self.backend.id_to_token(token_id)
            back = self.backend.token_to_id(token) if token is not None else None
            table[token_id] = back if back is not None else (hf.unk_token_id if hf.unk_token_id is not None
                                                             else token_id)
        if not numpy.array_equal(table, numpy.arange(size)):
            self.remap = table

    def encode(self, texts: list[str]) -> list:
        """One numpy int64 array of ids per text."""
        import numpy

        if self.backend is None:
            return [numpy.asarray(self.tokenizer.text_to_ids(text), dtype=numpy.int64) for text in texts]
        if self.fast is not None:
            ids = [numpy.asarray(row, dtype=numpy.int64) for row in self.fast.encode_batch_list(texts, parallel=False)]
        else:
            self.backend.encode_special_tokens = self.split_special_tokens
            encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
            ids = [numpy.asarray(encoding.ids, dtype=numpy.int64) for encoding in encodings]
        return [self.remap[array] for array in ids] if self.remap is not None else ids

    @property
    def name(self) -> str:
        """Which encoder runs, with its version (for the sidecar)."""
        from importlib.metadata import version

        if self.backend is None:
            return f"transformers {version('transformers')} (text by text)"
        return f"gigatoken {version('gigatoken')}" if self.fast is not None else f"tokenizers {version('tokenizers')}"
