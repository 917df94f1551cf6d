"""`dmt data prepare`: input files -> Megatron indexed datasets (PREFIX_<key>_document.bin/.idx, one pair a key),
the same bytes as Megatron-LM's tools/preprocess_data.py at core_v0.16.1 with --tokenizer-type HuggingFaceTokenizer,
and the PREFIX.dmt.json sidecar.

The reference sends one line at a time to its workers and encodes one document per call through transformers'
Python wrapper; here the main process cuts the inputs into blocks, the workers parse and encode a whole block in
one batch call (toolkit/data/tokenizer.py), and the main process appends each block's documents to Megatron-Core's
own builders in one write. At most two blocks per worker are in flight, so memory follows the workers, not the
input. A worker that dies (killed from outside) ends the run at once, in one line. Files are written under temporary names and renamed into place at the end, the sidecar last; a failure or an
interrupt removes what was written.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from toolkit import __version__
from toolkit.compat.megatron_datasets_seams import append_documents, indexed_dataset_builder
from toolkit.data import sidecar, sources
from toolkit.data import tokenizer as tokenizers
from toolkit.data.tokenizer import BatchEncoder, identity
from toolkit.errors import UserInputError, interrupted
from toolkit.numeric import json_text
from toolkit.outputs import output_file, write_file

TASKS_PER_WORKER = 2  # blocks in flight per worker: one being encoded, one waiting
END_WAIT_S = 60.0  # how long a run stopped early waits for the blocks its workers hold (each takes well under 1 s)


@dataclass
class KeyCounts:
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    max_token_id: int = -1


@dataclass
class InputRead:
    lines: int = 0  # lines (rows) of the inputs: documents
    text_bytes: int = 0  # their bytes, uncompressed


@dataclass
class Prepared:
    sidecar: dict
    seconds: float
    documents: int
    text_bytes: int
    files: list[Path] = field(default_factory=list)


def output_names(prefix: Path, keys: list[str]) -> dict[str, tuple[Path, Path]]:
    """{key: (.bin, .idx)} of an output prefix."""
    return {key: (Path(sidecar.dataset_prefix(prefix, key) + ".bin"), Path(sidecar.dataset_prefix(prefix, key) + ".idx"))
            for key in keys}


def check_keys(keys: list[str]) -> list[str]:
    for key in keys:
        if not key or "/" in key or "\0" in key or key in (".", ".."):
            raise UserInputError("--json-keys", f"{key!r} cannot name a file (PREFIX_<key>_document.bin); give JSON "
                                                f"keys or parquet columns without '/'")
    duplicated = sorted({key for key in keys if keys.count(key) > 1})
    if duplicated:
        raise UserInputError("--json-keys", f"{', '.join(duplicated)} given twice; each key makes one dataset")
    return keys


def prepare(inputs: list[Path], tokenizer_dir: Path, prefix: Path, keys: list[str], append_eod: bool, workers: int,
            progress: Callable[[int, int, int], None] | None = None, block_bytes: int = sources.BLOCK_BYTES) -> Prepared:
    """Prepare the datasets (see the module). `progress(documents, disk_bytes, text_bytes)` is called as blocks are
    written, with the increments."""
    check_keys(keys)
    if workers < 1:
        raise UserInputError("--workers", f"must be at least 1, got {workers}")
    if Path(prefix).is_dir() or str(prefix).endswith(os.sep):
        raise UserInputError("--output-prefix", f"{prefix} is a directory; give a file name prefix in it "
                                                f"({Path(prefix) / 'corpus'} writes corpus_<key>_document.bin, ...)")
    targets = output_names(prefix, keys)
    for bin_path, idx_path in targets.values():
        for path in (bin_path, idx_path):
            output_file(path, "--output-prefix", inputs=[*inputs, tokenizer_dir])
    record_path = output_file(sidecar.sidecar_path(prefix), "--output-prefix", inputs=[*inputs, tokenizer_dir])
    found = [sources.source_of(path, keys) for path in inputs]
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker: --workers is the cores it uses

    loaded = tokenizers.load_tokenizer(tokenizer_dir)
    if append_eod and loaded.eod is None:
        raise UserInputError("--append-eod", f"the tokenizer in {tokenizer_dir} has no end-of-document (eos) token")
    started = time.monotonic()
    temporary = {key: tuple(path.with_name(f".{path.name}.tmp-{os.getpid()}") for path in pair)
                 for key, pair in targets.items()}
    try:
        counts, documents, text_bytes = _write(found, keys, loaded, append_eod, workers, temporary, progress,
                                               block_bytes)
        record = _record(found, tokenizer_dir, loaded, prefix, keys, append_eod, counts, _WORKER.encoder.name)
        record_path.unlink(missing_ok=True)  # the old record goes first: from here its datasets are replaced
        for key, (bin_path, idx_path) in targets.items():
            idx_path.unlink(missing_ok=True)
            os.replace(temporary[key][0], bin_path)
            os.replace(temporary[key][1], idx_path)
        write_file(record_path, _json(record), "--output-prefix")
    except KeyboardInterrupt as exc:
        _remove(temporary)
        raise interrupted(exc, f"removed the partial files of {prefix}") from None
    except BaseException:
        _remove(temporary)
        raise
    files = [path for pair in targets.values() for path in pair] + [record_path]
    return Prepared(record, time.monotonic() - started, documents, text_bytes, files)


def _json(record: dict) -> str:
    return json_text(record, indent=1) + "\n"


def _remove(temporary: dict) -> None:
    for pair in temporary.values():
        for path in pair:
            path.unlink(missing_ok=True)


def _write(found, keys, loaded, append_eod, workers, temporary, progress, block_bytes):
    import numpy
    from megatron.core.datasets.indexed_dataset import DType

    dtype = DType.optimal_dtype(loaded.vocab_size)
    counts = {key: KeyCounts() for key in keys}
    read = InputRead()
    global _WORKER
    _WORKER = _Worker(loaded, keys, append_eod, numpy.dtype(dtype))  # inherited by the forked workers
    # the workers first: an interrupt while they fork is lost (CPython ignores exceptions in its at-fork hooks), so
    # the files appear only once the workers are there, and Ctrl-C from then on removes them
    pool = _Workers(workers)
    builders, pending = {}, deque()  # pending: (block, the worker it was handed to) not yet written
    try:
        builders.update({key: indexed_dataset_builder(str(temporary[key][0]), dtype) for key in keys})
        for source in found:
            lines = 0
            for chunk in sources.chunks(source, keys, block_bytes=block_bytes):
                pending.append((chunk, pool.hand(chunk)))
                while len(pending) >= TASKS_PER_WORKER * workers:
                    lines = _take(pending.popleft(), pool, lines, builders, counts, read, progress)
            while pending:
                lines = _take(pending.popleft(), pool, lines, builders, counts, read, progress)
        for key, builder in builders.items():
            builder.finalize(str(temporary[key][1]))
    finally:
        pool.close()
        for builder in builders.values():
            builder.data_file.close()
    return counts, read.lines, read.text_bytes


class _Workers:
    """The encoding processes, each with its own two pipes: blocks are dealt to them in turn and their results read
    back in the order handed out. Nothing is shared between the processes (multiprocessing.Pool shares one task
    queue and one result queue, each behind a lock): a worker killed at any moment, from outside (the out-of-memory
    killer) or by the end of a run, leaves no lock held that another process then waits on forever, and its death is
    seen at once (its process sentinel), not as a block that never comes back."""

    def __init__(self, count: int):
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self.workers = []  # (process, its task pipe's sending end, its result pipe's receiving end)
        self.turn, self.lost = 0, False
        self.exitcodes: list[int | None] = []
        parent_ends = []
        for _ in range(count):
            task_reader, task_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            parent_ends += [task_writer, result_reader]
            # the child closes the parent's ends it inherits: the end of a pipe is then seen when its one holder goes
            process = context.Process(target=_serve, args=(task_reader, result_writer, list(parent_ends)),
                                      daemon=True)
            self.workers.append((process, task_writer, result_reader))
            process.start()
            task_reader.close()  # nor does a worker forked later inherit this one's ends
            result_writer.close()

    def hand(self, chunk: sources.Chunk) -> int:
        """Send a block to the next worker in turn; that worker's number."""
        number, self.turn = self.turn % len(self.workers), self.turn + 1
        tasks = self.workers[number][1]
        try:
            tasks.send(chunk)
        except OSError:  # BrokenPipeError: it is gone
            self._lost(number, chunk)
        return number

    def result(self, number: int, chunk: sources.Chunk):
        """The next result of worker `number` (the block `chunk`), or one line if the worker is gone."""
        from multiprocessing.connection import wait

        process, _, results = self.workers[number]
        wait([results, process.sentinel])
        if results.poll():
            try:
                outcome = results.recv()
            except (EOFError, OSError):  # it died writing, or before
                self._lost(number, chunk)
            if isinstance(outcome, _Failed):  # a failure of the encoder's own: raised here, as the pool raised it
                raise outcome.error
            return outcome
        self._lost(number, chunk)

    def _lost(self, number: int, chunk: sources.Chunk):
        self.lost = True  # the run is over: what the other workers hold is not waited for
        process = self.workers[number][0]
        process.join(1.0)
        code = process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"ended (exit code {code})"
        raise UserInputError("--workers", f"a worker (pid {process.pid}) {how} while encoding a block of "
                                          f"{chunk.source} (the out-of-memory killer sends signal 9): nothing was "
                                          f"written; fewer --workers use less memory")

    def close(self) -> None:
        """Each worker finishes the blocks it holds (at most TASKS_PER_WORKER, when a bad line or Ctrl-C stops the
        run early; what it sends is read and dropped, so it never waits on a full pipe) and exits; one still there
        after END_WAIT_S, or a second Ctrl-C, or any once a worker was lost, is killed (safe here: no process holds
        a lock another waits on)."""
        from multiprocessing.connection import wait

        for _, tasks, _ in self.workers:
            tasks.close()  # the worker reads its end of input once its blocks are done
        deadline = time.monotonic() + (0.0 if self.lost else END_WAIT_S)
        try:
            for process, _, results in self.workers:
                while time.monotonic() < deadline:
                    ready = wait([results, process.sentinel], max(0.0, deadline - time.monotonic()))
                    if results not in ready:
                        break
                    try:
                        results.recv()
                    except (EOFError, OSError):
                        break
                process.join(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
            pass
        finally:
            for process, _, results in self.workers:
                if process.is_alive():
                    process.kill()
                process.join()
                results.close()
            self.exitcodes = [process.exitcode for process, _, _ in self.workers]


@dataclass
class _Failed:
    """An exception a worker's encoding raised (a BadDocument is returned as a value, not raised: _encode_chunk)."""

    error: BaseException


def _serve(tasks, results, inherited) -> None:
    """A worker: encode the blocks that arrive, send each result back in order, exit at the end of the input. A
    thread reads the blocks as they come, so the parent's send of a block never waits on this process's send of a
    result (each would wait on the other with a block of about 1 MiB and a pipe of 64 KiB)."""
    import queue
    import threading

    for end in inherited:
        end.close()
    _ignore_interrupts()
    arrived: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        while True:
            try:
                arrived.put(tasks.recv())
            except (EOFError, OSError):
                arrived.put(None)
                return

    threading.Thread(target=receive, daemon=True).start()
    while (chunk := arrived.get()) is not None:
        try:
            outcome = _encode_chunk(chunk)
        except Exception as exc:  # noqa: BLE001 (the parent raises it)
            outcome = _Failed(exc)
        try:
            results.send(outcome)
        except (BrokenPipeError, OSError):  # the parent stopped reading: the run is over
            return


def _take(entry, pool: _Workers, lines_before, builders, counts, read, progress) -> int:
    """Write one encoded chunk (or raise its refusal, naming the file and line); the lines read so far."""
    chunk, number = entry
    encoded = pool.result(number, chunk)
    if isinstance(encoded, sources.BadDocument):
        unit = "row" if chunk.kind == "parquet" else "line"
        raise UserInputError("--input", f"{chunk.source} {unit} {lines_before + encoded.where} {encoded.message}")

    per_key, lines = encoded
    read.lines += lines
    read.text_bytes += chunk.text_bytes
    for key, (tokens, sequence_lengths, per_document, max_id) in per_key.items():
        append_documents(builders[key], tokens, sequence_lengths, per_document)
        total = counts[key]
        total.documents += len(per_document)
        total.sequences += len(sequence_lengths)
        total.tokens += len(tokens)
        total.max_token_id = max(total.max_token_id, max_id)
    if progress is not None:
        progress(lines, chunk.disk_bytes, chunk.text_bytes)
    return lines_before + lines


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process handles it


class _Worker:
    """What each worker encodes with: the tokenizer, keys and flags of the run (set before the pool forks)."""

    def __init__(self, tokenizer, keys, append_eod, dtype):
        self.encoder, self.keys, self.append_eod, self.dtype = BatchEncoder(tokenizer), keys, append_eod, dtype
        self.eod = tokenizer.eod


_WORKER: _Worker | None = None


def _encode_chunk(chunk: sources.Chunk):
    """({key: (tokens, sequence lengths, sequences per document, max id)}, lines) of a chunk, or the BadDocument
    that stops it (returned: an exception's own pickling would lose its fields)."""
    try:
        found, lines = sources.documents(chunk, _WORKER.keys)
        return {key: _encode_documents(found[key]) for key in _WORKER.keys}, lines
    except sources.BadDocument as bad:
        return bad


def _encode_documents(documents: list[list[str]]):
    """The reference's Encoder.encode over many documents: each sentence tokenized, the empty ones dropped, the eod
    appended to a document's last sentence when asked and the document is not empty."""
    import numpy

    worker = _WORKER
    sentences = [sentence for document in documents for sentence in document]
    try:
        ids = worker.encoder.encode(sentences)
    except (TypeError, ValueError, UnicodeError):  # a lone surrogate (an escape JSON allows) has no UTF-8
        _find_unencodable(documents)
        raise
    pieces, lengths, per_document, position = [], [], [], 0
    for document in documents:
        kept = [array for array in ids[position:position + len(document)] if len(array)]
        position += len(document)
        if kept and worker.append_eod:
            kept[-1] = numpy.append(kept[-1], worker.eod)
        pieces += kept
        lengths += [len(array) for array in kept]
        per_document.append(len(kept))
    tokens = numpy.concatenate(pieces) if pieces else numpy.zeros(0, dtype=numpy.int64)
    max_id = int(tokens.max()) if len(tokens) else -1
    return tokens.astype(worker.dtype), numpy.asarray(lengths, dtype=numpy.int64), \
        numpy.asarray(per_document, dtype=numpy.int64), max_id


def _find_unencodable(documents: list[list[str]]) -> None:
    for number, document in enumerate(documents, 1):
        for sentence in document:
            try:
                sentence.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise sources.BadDocument(number, f"holds {exc.object[exc.start]!r}, a lone surrogate, which no "
                                                  f"tokenizer encodes") from None


def _record(found, tokenizer_dir, loaded, prefix, keys, append_eod, counts, encoder: str) -> dict:
    from megatron.core.datasets.indexed_dataset import DType

    return {
        "format": sidecar.FORMAT, "version": sidecar.VERSION,
        "made_by": f"dm-toolkit {__version__} `dmt data prepare`",
        "same_bytes_as": "Megatron-LM tools/preprocess_data.py at core_v0.16.1, --tokenizer-type "
                         "HuggingFaceTokenizer --tokenizer-model TOKENIZER, with the same --json-keys and --append-eod",
        "tokenizer": identity(tokenizer_dir, loaded),
        "encoder": encoder,
        "inputs": [{"path": str(source.path.resolve()), "bytes": source.size, "format": source.kind
                    + (".gz" if source.gzipped else "")} for source in found],
        "keys": keys, "append_eod": append_eod,
        "dtype": DType.optimal_dtype(loaded.vocab_size).__name__,
        "datasets": {key: {"prefix": Path(sidecar.dataset_prefix(prefix, key)).name, "documents": c.documents,
                           "sequences": c.sequences, "tokens": c.tokens, "max_token_id": c.max_token_id}
                     for key, c in counts.items()},
    }
