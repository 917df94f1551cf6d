"""`dmt data prepare` against Megatron-LM's own tools/preprocess_data.py (core_v0.16.1), side by side on one generated
corpus with the same number of workers: documents/s, MB/s, peak memory, and whether the files are the same bytes.

  git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
  pip install --target /tmp/six six
  PYTHONPATH=/tmp/six .venv/bin/python benchmarks/data_prepare.py Megatron-LM --mb 200 --workers 2

Peak memory is the most resident memory the whole process tree (the command, its workers) held at once, sampled
every 50 ms, and each tree's largest single process. The corpus is JSON lines of sentences drawn from the tiny
corpus with non-ASCII words, documents of 200 B to 20 KB (log-normal); the tokenizer is tests/data/tokenizer.
Results: benchmarks/data_prepare.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "data"))
from record_megatron_preprocess import reference_command  # noqa: E402

TOKENIZER = ROOT / "tests" / "data" / "tokenizer"
EXTRA_WORDS = ["naïve", "café", "日本語", "Ελληνικά", "🤗", "straße", "—", "«quoted»"]


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """A JSON lines corpus of about `megabytes` MiB; the number of documents."""
    rng = random.Random(seed)
    sentences = [s.strip() + "." for line in (ROOT / "recipes" / "data" / "tiny_corpus.txt").read_text().splitlines()
                 for s in line.split(".") if s.strip()]
    written = documents = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < megabytes * 2**20:
            target = min(20_000, max(200, int(rng.lognormvariate(math.log(1500), 0.9))))
            parts, size = [], 0
            while size < target:
                part = rng.choice(sentences) if rng.random() > 0.05 else rng.choice(EXTRA_WORDS)
                parts.append(part)
                size += len(part) + 1
            line = json.dumps({"text": " ".join(parts)}, ensure_ascii=rng.random() < 0.5) + "\n"
            out.write(line)
            written += len(line.encode())
            documents += 1
    return documents


def measured_run(command: list[str], env: dict) -> dict:
    """Run `command`; its wall time and the peak resident memory of its process tree (sum, and largest process)."""
    import psutil

    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    top = psutil.Process(process.pid)
    peak_tree = peak_one = 0
    while process.poll() is None:
        try:
            tree = [top, *top.children(recursive=True)]
            sizes = [p.memory_info().rss for p in tree]
        except psutil.Error:
            sizes = []
        peak_tree, peak_one = max(peak_tree, sum(sizes)), max([peak_one, *sizes])
        time.sleep(0.05)
    stderr = process.stderr.read()
    if process.returncode != 0:
        raise SystemExit(f"{command[:3]}... failed ({process.returncode}):\n{stderr[-3000:]}")
    return {"seconds": time.monotonic() - started, "peak_rss_tree_mb": peak_tree / 2**20,
            "peak_rss_process_mb": peak_one / 2**20}


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("checkout", type=Path, help="a Megatron-LM checkout at core_v0.16.1")
    cli.add_argument("--mb", type=int, default=200, help="corpus size in MiB (default 200)")
    cli.add_argument("--workers", type=int, default=2)
    cli.add_argument("--workdir", type=Path, default=None, help="where the corpus and outputs go (default: a temp dir)")
    options = cli.parse_args()
    work = options.workdir or Path(tempfile.mkdtemp(prefix="dmt-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    documents = write_corpus(corpus, options.mb)
    size_mb = corpus.stat().st_size / 2**20
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    workers = str(options.workers)
    runs = {
        "Megatron-LM preprocess_data.py": measured_run(reference_command(options.checkout.resolve(), [
            "--input", str(corpus), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(TOKENIZER),
            "--json-keys", "text", "--append-eod", "--workers", workers, "--output-prefix", str(work / "reference")]),
            env),
        "dmt data prepare": measured_run([sys.executable, "-m", "toolkit", "data", "prepare", "--input", str(corpus),
                                          "--tokenizer", str(TOKENIZER), "--append-eod", "--workers", workers,
                                          "--output-prefix", str(work / "dmt")],
                                         dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))),
    }
    same = all(filecmp.cmp(work / f"reference_text_document{s}", work / f"dmt_text_document{s}", shallow=False)
               for s in (".bin", ".idx"))
    encoder = json.loads((work / "dmt.dmt.json").read_text())["encoder"]
    print(f"corpus: {size_mb:.1f} MiB, {documents} documents; {options.workers} workers; {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}); dmt's encoder: {encoder}; same bytes: "
          f"{'yes' if same else 'NO'}")
    print("| tool | wall s | documents/s | MB/s | peak RSS, process tree (MiB) | peak RSS, largest process (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, run in runs.items():
        print(f"| {name} | {run['seconds']:.1f} | {documents / run['seconds']:,.0f} | {size_mb / run['seconds']:.2f} | "
              f"{run['peak_rss_tree_mb']:.0f} | {run['peak_rss_process_mb']:.0f} |")
    reference, ours = runs.values()
    print(f"speed-up (wall time, startup included): {reference['seconds'] / ours['seconds']:.1f}x")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
