"""`dmt convert fsdp-to-hf` against `accelerate merge-weights` on the same FSDP2 checkpoint of a ~250M model.

Run: .venv/bin/python benchmarks/fsdp_to_hf_speed.py [--workdir DIR] [--write benchmarks/fsdp_to_hf_speed.md]
The checkpoint is saved once by 2 CPU ranks the way Accelerate saves SHARDED_STATE_DICT (benchmarks/fsdp_save.py)
and kept in --workdir. Each tool runs as its own command (`dmt convert fsdp-to-hf`, `accelerate merge-weights`);
its wall time and peak RSS (ru_maxrss of the child, from wait4) are reported, with `cp -r` of the DCP directory as
the I/O floor (its RSS is cp's own); the outputs are compared tensor by tensor (bitwise). All runs read from a warm
page cache. Ours fsyncs its output before the final rename (the atomic-output guarantee); merge-weights does not.
Target (issue 15): at most 1/3 of merge-weights' peak RSS and no slower.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REPEATS = 3


def measure(cmd: list[str]) -> dict:
    """Wall seconds and peak RSS (MiB) of one command, read from the kernel's accounting of that child."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {process.stderr.read().decode()[-2000:]}")
    return {"seconds": seconds, "peak_rss_mib": usage.ru_maxrss / 1024}


def ensure_checkpoint(workdir: Path) -> Path:
    ckpt = workdir / "fsdp-250m"
    if (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return ckpt
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29663",
           str(ROOT / "benchmarks/fsdp_save.py"), str(ckpt)]
    subprocess.run(cmd, check=False, env=dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}"), capture_output=True)
    if not (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file():
        raise SystemExit("saving the benchmark checkpoint failed")
    return ckpt


SAME_TENSORS = """
import sys
from pathlib import Path
from safetensors import safe_open

def read(directory):
    found = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="np") as handle:
            found.update({key: handle.get_tensor(key) for key in handle.keys()})
    return found

a, b = read(sys.argv[1]), read(sys.argv[2])
print(sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a))
"""


def same_tensors(ours: Path, theirs: Path) -> bool:
    """Compared in a child: loading both models here would raise the peak RSS every later child inherits (Linux keeps
    ru_maxrss across fork and exec)."""
    out = subprocess.run([sys.executable, "-c", SAME_TENSORS, str(ours), str(theirs)], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip() == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dmt-bench")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = ensure_checkpoint(args.workdir)
    dcp = ckpt / "pytorch_model_fsdp_0"
    size = sum(f.stat().st_size for f in dcp.iterdir())
    load = os.getloadavg()[0]
    tools = {
        "dmt convert fsdp-to-hf": lambda out: [str(BIN / "dmt"), "convert", "fsdp-to-hf", str(ckpt), str(out)],
        "accelerate merge-weights": lambda out: [str(BIN / "accelerate"), "merge-weights", str(dcp), str(out)],
        "cp -r (I/O floor)": lambda out: ["cp", "-r", str(dcp), str(out)],
    }
    outs = {name: args.workdir / f"out-{index}" for index, name in enumerate(tools)}
    runs: dict[str, list[dict]] = {name: [] for name in tools}
    for _ in range(REPEATS):  # interleaved, so a burst of load on the machine hits every tool alike
        for name, command in tools.items():
            shutil.rmtree(outs[name], ignore_errors=True)
            runs[name].append(measure(command(outs[name])))
    results = {name: {key: statistics.median(r[key] for r in rs) for key in ("seconds", "peak_rss_mib")}
               for name, rs in runs.items()}
    identical = same_tensors(outs["dmt convert fsdp-to-hf"], outs["accelerate merge-weights"])
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)

    lines = [f"machine: {platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}, "
             f"load average before the runs {load:.1f}; medians of {REPEATS} runs each",
             f"checkpoint: FSDP2 SHARDED_STATE_DICT (torch DCP), 2 ranks, ~254M-parameter Llama (fp32), "
             f"{size / 2**30:.2f} GiB on disk", f"outputs identical tensor by tensor (bitwise): {identical}", "",
             "| tool | wall s | peak RSS MiB |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['seconds']:.2f} | {v['peak_rss_mib']:.0f} |" for k, v in results.items()]
    ours, theirs = results["dmt convert fsdp-to-hf"], results["accelerate merge-weights"]
    lines += ["", f"time ratio ours/merge-weights: {ours['seconds'] / theirs['seconds']:.2f} (target <= 1)",
              f"peak RSS ratio ours/merge-weights: {ours['peak_rss_mib'] / theirs['peak_rss_mib']:.2f} "
              f"(target <= 0.33)"]
    report = "\n".join(lines)
    print(report)
    if args.write:
        args.write.write_text("# fsdp-to-hf vs accelerate merge-weights\n\nGenerated by "
                              "`benchmarks/fsdp_to_hf_speed.py`.\n\n" + report + "\n")


if __name__ == "__main__":
    main()
