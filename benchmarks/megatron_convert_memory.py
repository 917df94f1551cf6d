"""Peak RSS of `dmt convert hf-to-megatron` and `megatron-to-hf` on two model sizes with the same largest tensor.

Run: .venv/bin/python benchmarks/megatron_convert_memory.py [--workdir DIR]
                                                     [--write benchmarks/megatron_convert_memory.md]
Two Llama-shaped models, hidden 1024 and vocabulary 16000 (so the same 62.5 MiB embedding is the largest tensor of
both), 6 and 28 layers (~110M and ~390M parameters), with random fp32 weights, are written as HF safetensors tensor
by tensor (a shared benchmark machine need not hold the larger model whole to make it). A 2-layer, hidden-64 model
gives the fixed cost (Python, torch, Megatron-Core, transformers imports). Each conversion is its own `dmt convert`
process; its peak RSS is that process's ru_maxrss (os.wait4), which varies from run to run by about one largest
tensor (hence --repeat and the median). Issue 6: peak RSS bounded by the largest tensor plus a constant, not by model
size. tests/megatron/test_megatron_convert_streaming.py asserts the bound exactly, counting tensor bytes.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LLAMA = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=16000, max_position_embeddings=2048, tie_word_embeddings=False)
MODELS = {"tiny (fixed cost)": dict(LLAMA, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=300, num_hidden_layers=2),
          "~110M": dict(LLAMA, num_hidden_layers=6), "~390M": dict(LLAMA, num_hidden_layers=28)}


def write_random_hf_model(config: dict, hf_dir: Path) -> tuple[int, int]:
    """config.json + model.safetensors with N(0, 0.02) weights and unit norms; returns (parameters, largest bytes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.checkpoint.safetensors_stream import StreamingSafetensorsWriter

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(hf_config).state_dict().items()}
    hf_dir.mkdir(parents=True)
    hf_config.save_pretrained(hf_dir)
    layout = [(name, shape, torch.float32) for name, shape in shapes.items()]
    writer = StreamingSafetensorsWriter(hf_dir / "model.safetensors", layout)
    generator = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        tensor = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
        writer.write(name, tensor)
    writer.close()
    numels = [torch.Size(s).numel() for s in shapes.values()]
    return sum(numels), 4 * max(numels)


def peak_rss(*args: str) -> tuple[float, float]:
    """(peak RSS MiB, wall s) of one `dmt` process."""
    start = time.perf_counter()
    process = subprocess.Popen([str(BIN / "dmt"), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"dmt {' '.join(args)} failed: {process.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 1024, seconds


def summary(runs: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """(median peak RSS, lowest, highest, median wall s) of repeated runs."""
    peaks, seconds = sorted(r[0] for r in runs), sorted(r[1] for r in runs)
    return peaks[len(peaks) // 2], peaks[0], peaks[-1], seconds[len(seconds) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dmt-bench-megatron")
    parser.add_argument("--write", type=Path)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each conversion (peak RSS varies by one "
                                                                 "large tensor from run to run)")
    args = parser.parse_args()
    rows = []
    for name, config in MODELS.items():
        work = args.workdir / name.split()[0].strip("~")
        shutil.rmtree(work, ignore_errors=True)
        parameters, largest = write_random_hf_model(config, work / "hf")
        to_megatron, to_hf = [], []
        for _ in range(args.repeat):
            for path in ("mcore", "back"):
                shutil.rmtree(work / path, ignore_errors=True)
            to_megatron.append(peak_rss("convert", "hf-to-megatron", str(work / "hf"), str(work / "mcore")))
            to_hf.append(peak_rss("convert", "megatron-to-hf", str(work / "mcore"), str(work / "back")))
        to_megatron, to_hf = summary(to_megatron), summary(to_hf)
        size = (work / "hf" / "model.safetensors").stat().st_size
        rows.append((name, parameters, size, largest, to_megatron, to_hf))
        shutil.rmtree(work, ignore_errors=True)

    load = os.getloadavg()[0]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [f"machine: {platform.node()}, {os.cpu_count()} cores, {memory:.0f} GiB RAM, python "
             f"{platform.python_version()}, load average {load:.1f} at the end (the machine is shared)", "",
             f"Each conversion ran {args.repeat} times: median peak RSS, [lowest-highest], (median wall s).", "",
             "| model | parameters | HF fp32 MiB | largest tensor MiB | hf-to-megatron peak RSS MiB | "
             "megatron-to-hf peak RSS MiB |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {p / 1e6:.1f}M | {size / 2**20:.0f} | {largest / 2**20:.1f} | "
              f"{a[0]:.0f} [{a[1]:.0f}-{a[2]:.0f}] ({a[3]:.1f} s) | {b[0]:.0f} [{b[1]:.0f}-{b[2]:.0f}] ({b[3]:.1f} s) |"
              for name, p, size, largest, a, b in rows]
    (_, _, _, _, base_a, base_b), (_, _, small, _, a1, b1), (_, _, large, largest, a2, b2) = rows
    lines += ["", f"model {large / small:.1f}x larger: median peak RSS above the fixed cost (tiny model) "
                  f"{a1[0] - base_a[0]:.0f} -> {a2[0] - base_a[0]:.0f} MiB (hf-to-megatron), "
                  f"{b1[0] - base_b[0]:.0f} -> {b2[0] - base_b[0]:.0f} MiB (megatron-to-hf); "
                  f"largest tensor {largest / 2**20:.1f} MiB"]
    report = "\n".join(lines)
    print(report)
    if args.write:
        args.write.write_text("# Megatron conversion memory\n\nGenerated by `benchmarks/megatron_convert_memory.py`."
                              "\n\n" + report + "\n")


if __name__ == "__main__":
    main()
