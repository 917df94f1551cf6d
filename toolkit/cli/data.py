"""`dmt data prepare|inspect`: tokenise input files into Megatron indexed datasets (the same bytes as Megatron-LM's
tools/preprocess_data.py), and check and summarise what a prefix holds."""

from __future__ import annotations

import argparse
import os
import sys

from toolkit.cli.paths import output_arg, path_arg
from toolkit.data.inspect import inspect
from toolkit.data.prepare import prepare
from toolkit.numeric import bounded_int, json_text


def _prefix(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a prefix (PREFIX.dmt.json, or PREFIX.bin and PREFIX.idx)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    prepare = sub.add_parser("prepare", help="tokenise JSON lines, parquet or text into PREFIX_<key>_document.bin/.idx "
                                             "(Megatron-LM's preprocess_data.py bytes) and PREFIX.dmt.json")
    prepare.add_argument("--input", type=path_arg, nargs="+", required=True, metavar="PATH",
                         help="JSON lines (.jsonl/.json, also .gz), parquet, or plain text (.txt: a line a document); "
                              "several are read in order")
    prepare.add_argument("--tokenizer", type=path_arg, required=True, metavar="DIR",
                         help="a Hugging Face tokenizer directory (what Megatron-LM's --tokenizer-model takes)")
    prepare.add_argument("--output-prefix", type=output_arg, required=True, metavar="PREFIX")
    prepare.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                         help="the JSON keys (parquet columns) to tokenise, one dataset each (default: text)")
    prepare.add_argument("--append-eod", action="store_true",
                         help="end every non-empty document with the tokenizer's end-of-document token")
    prepare.add_argument("--workers", type=bounded_int, default=None, metavar="N",
                         help="worker processes (default: the CPUs this process may use)")
    prepare.add_argument("--json", action="store_true", help="print the sidecar and the throughput as one object")
    inspect = sub.add_parser("inspect", help="documents, tokens, dtype, document lengths and the first document of "
                                             "a prefix; a damaged or incomplete dataset is one line")
    inspect.add_argument("prefix", type=_prefix, metavar="PREFIX",
                         help="the --output-prefix of `dmt data prepare`, or a Megatron dataset prefix")
    inspect.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.action == "inspect":
        summary = inspect(args.prefix)
        print(json_text(summary, indent=2) if args.json else _inspect_text(summary))
        return 0
    return _prepare(args)


def _prepare(args: argparse.Namespace) -> int:
    workers = args.workers if args.workers is not None else len(os.sched_getaffinity(0))
    bar = _progress_bar(args.input) if sys.stderr.isatty() else None
    try:
        done = prepare(args.input, args.tokenizer, args.output_prefix, args.json_keys, args.append_eod, workers,
                       progress=bar.advance if bar else None)
    finally:
        if bar:
            bar.close()
    rates = {"seconds": round(done.seconds, 3), "documents_per_s": round(done.documents / max(done.seconds, 1e-9), 1),
             "mb_per_s": round(done.text_bytes / 2**20 / max(done.seconds, 1e-9), 2), "workers": workers}
    if args.json:
        print(json_text({**done.sidecar, "throughput": rates, "files": [str(p) for p in done.files]}, indent=2))
        return 0
    for key, entry in done.sidecar["datasets"].items():
        print(f"{key}: {entry['documents']} documents, {entry['tokens']} tokens ({done.sidecar['dtype']}) -> "
              f"{args.output_prefix}_{key}_document.bin/.idx")
    print(f"{done.documents} documents in {rates['seconds']} s ({rates['documents_per_s']} documents/s, "
          f"{rates['mb_per_s']} MB/s, {workers} workers); record: {done.files[-1]}")
    return 0


class _progress_bar:  # noqa: N801 (a tqdm bar on a terminal: bytes of the inputs, documents/s and MB/s)
    def __init__(self, inputs):
        import time

        from tqdm import tqdm

        self.started, self.documents, self.text_bytes = time.monotonic(), 0, 0
        total = sum(path.stat().st_size for path in inputs if path.is_file())
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="dmt data prepare",
                        file=sys.stderr, dynamic_ncols=True)

    def advance(self, documents: int, disk_bytes: int, text_bytes: int) -> None:
        import time

        self.documents += documents
        self.text_bytes += text_bytes
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.documents / elapsed:,.0f} documents/s, "
                                 f"{self.text_bytes / 2**20 / elapsed:,.1f} MB/s", refresh=False)
        self.bar.update(disk_bytes)

    def close(self) -> None:
        self.bar.close()


def _inspect_text(summary: dict) -> str:
    lines = [f"{summary['prefix']}: " + (f"recorded in {summary['sidecar']}" if summary["sidecar"] else
                                         "a Megatron dataset (no dmt sidecar)")]
    if summary["tokenizer"]:
        lines.append(f"tokenizer: {summary['tokenizer']['path']} (vocabulary {summary['tokenizer']['vocab_size']})")
    for key, data in summary["datasets"].items():
        lines.append(f"{key}: {data['documents']} documents ({data['empty_documents']} empty), {data['sequences']} "
                     f"sequences, {data['tokens']} tokens, {data['dtype']}; {' '.join(data['files'])}")
        lengths = data.get("document_tokens")
        if lengths:
            lines.append("  tokens per document: " + ", ".join(f"{name} {value:g}" for name, value in lengths.items()))
        first = data.get("first_document")
        if first:
            shown = repr(first["text"][:300]) if "text" in first else f"not decoded: {first['not_decoded']}"
            lines.append(f"  first document ({first['tokens']} tokens): {shown}")
    return "\n".join(lines)
