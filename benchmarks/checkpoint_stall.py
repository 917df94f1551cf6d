"""How long a checkpoint stalls training, synchronous against asynchronous (training.async_save), per backend: a
~260M-parameter random-init Llama trained by toolkit/train.py on 2 CPU ranks (torchrun, gloo) for a few steps with a
save in the middle and at the end, read back from each run's metrics.jsonl checkpoint records (`blocking_s`: the time
training was paused; `persist_s`: until the files and manifest were complete; `bytes`).

Run: python benchmarks/checkpoint_stall.py [--out benchmarks/checkpoint_stall.md] [--steps 12] [--layers 22]
(a launch each: under the launch lock on a shared machine, `flock /tmp/dmt-launch.lock python ...`). Each run's output
directory (a few GB of checkpoints) is removed once its records are read.
On a GPU machine: `--gpu` trains on the GPUs there (NCCL, one rank per GPU, bf16, Megatron-Core's `local` layer spec
where Transformer Engine is missing) with a longer sequence and batch (GPU_SHAPE) and `--steps 400` or so, so that
the steps between the two saves outlast a background write as they do on CPU; `--log-dir` keeps each run's log.
Target: an asynchronous save blocks at most a quarter of the synchronous save's time, on every backend that has one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TARGET = 0.25  # async blocking / sync blocking
RECIPES = {"deepspeed": "tiny-llama-cpu.yaml", "fsdp": "tiny-llama-fsdp-cpu.yaml",
           "megatron": "tiny-llama-megatron-cpu.yaml"}  # each backend's tiny recipe: its plan and precision
PLAN_CHANGES = {"megatron": {"distributed_optimizer": True}}  # Adam's states sharded over the 2 ranks, as ZeRO-2 and
# FSDP2 shard them
# Megatron-Core's synchronous save writes the distributed optimizer fully_reshardable (gathered onto rank 0), its
# background save dp_reshardable (each rank's partition): a third run saves synchronously in the background save's
# format, so that the pause of the same format's two saves is compared too. Set here only (not a toolkit setting):
# train.py runs (as `python -m toolkit.train`) with toolkit.backends.megatron.checkpoint.SYNC_SHARDING replaced.
SAME_FORMAT = "dp_reshardable"
SAME_FORMAT_TRAIN = f"""import runpy
import toolkit.backends.megatron.checkpoint as checkpoint
checkpoint.SYNC_SHARDING = {SAME_FORMAT!r}
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
"""


def model_config(layers: int) -> dict:
    """Llama with hidden 1024 and GQA 16/8: ~11.8M parameters a layer; the tokenizer's 512-token vocabulary keeps the
    embeddings small, so the parameters are the layers'."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
            "intermediate_size": 2816, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 8, "vocab_size": 512, "max_position_embeddings": 128, "tie_word_embeddings": False,
            "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0}


def parameters(config: dict) -> int:
    from toolkit.estimate.params import count_params
    from toolkit.spec.model import spec_from_hf_dict

    return count_params(spec_from_hf_dict(config, name="bench")).total


CPU_SHAPE = {"seq_len": 32, "global_batch": 2, "micro_batch": 1}
GPU_SHAPE = {"seq_len": 2048, "global_batch": 8, "micro_batch": 2}  # a step of ~0.1-0.2 s on one H100/H200 (bf16)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def recipe(backend: str, asynchronous: bool, config: dict, steps: int, directory: Path, gpus: int = 0) -> Path:
    base = ROOT / "recipes" / RECIPES[backend]
    data = yaml.safe_load(base.read_text())
    data["name"] = f"stall-{backend}-{'async' if asynchronous else 'sync'}"
    data["data"]["train_files"] = [str(base.parent / f) for f in data["data"]["train_files"]]
    shape = GPU_SHAPE if gpus else CPU_SHAPE
    data["training"].update(max_steps=steps, save_steps=steps // 2, logging_steps=1, warmup_steps=1,
                            async_save=asynchronous, hang_timeout_s=900, report_to=["none"],
                            seq_len=shape["seq_len"], global_batch=shape["global_batch"])
    data["model"]["config"] = {**config, "max_position_embeddings": max(config["max_position_embeddings"],
                                                                         shape["seq_len"])}
    data["plan"]["micro_batch"] = shape["micro_batch"]
    data["plan"].update(PLAN_CHANGES.get(backend, {}))
    if gpus:
        data["cluster"].update(gpus=gpus, gpus_per_node=gpus, gpu="h100-80gb", accelerator="gpu")
        data["plan"]["precision"] = "bf16"
        if backend == "megatron" and importlib.util.find_spec("transformer_engine") is None:
            data["plan"]["transformer_impl"] = "local"
    path = directory / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(backend: str, asynchronous: bool, config: dict, steps: int, work: Path, same_format: bool = False,
        gpus: int = 0, log_dir: Path | None = None, timeout: float = 3600) -> dict:
    from toolkit.runtime.metrics import read_checkpoint_records, read_metrics

    name = f"{backend}-{asynchronous}{'-same-format' if same_format else ''}"
    out, log = work / name, (log_dir or work) / f"{name}.log"
    script = ROOT / "toolkit" / "train.py"
    if same_format:
        script = work / "train_same_format.py"
        script.write_text(SAME_FORMAT_TRAIN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus or 2), "--master_port",
           str(29400 + os.getpid() % 500), str(script), "--recipe",
           str(recipe(backend, asynchronous, config, steps, work, gpus)),
           "--output-dir", str(out)]
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               OMP_NUM_THREADS="1")
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # torchrun ends its ranks on SIGTERM (each in a session of its own)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = f"stopped after {timeout:.0f} s"
    saves, step_records = read_checkpoint_records(out), read_metrics(out)
    shutil.rmtree(out, ignore_errors=True)
    if rc != 0 or len(saves) != 2:  # kept in the table with what the launcher said (an OOM kill shows as -9)
        killed = sorted({line.strip() for line in log.read_text().splitlines() if "exitcode" in line})
        return {"backend": backend, "async": asynchronous, "same_format": same_format,
                "failed": f"exit {rc}, {len(saves)} of 2 checkpoint records; ranks: {'; '.join(killed)}"}
    middle, last = saves
    return {"backend": backend, "async": all(s["async"] for s in saves), "same_format": same_format,
            "bytes": middle["bytes"],
            "blocking_s": middle["blocking_s"], "persist_s": middle["persist_s"],
            "last_blocking_s": last["blocking_s"], "last_persist_s": last["persist_s"],
            "step_s": statistics.median(r["step_time_s"] for r in step_records[1:] if r.get("step_time_s")),
            "gpu_max_allocated_bytes": max((r.get("gpu_max_allocated_bytes", 0) for r in step_records), default=0)}


def machine(gpus: int = 0) -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    text = (f"{model}, {os.cpu_count()} cores, python {platform.python_version()}, load average before the runs "
            f"{os.getloadavg()[0]:.1f}")
    if gpus:
        import torch

        text += f"; {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return text


def table(results: list[dict], params: int, steps: int, gpus: int = 0) -> str:
    from toolkit.spec.backends import BACKENDS

    shape = GPU_SHAPE if gpus else CPU_SHAPE
    ranks = (f"{gpus} GPU rank{'s' if gpus > 1 else ''} (torchrun, NCCL, bf16)" if gpus
             else "2 CPU ranks (torchrun, gloo)")
    lines = [f"machine: {machine(gpus)}",
             f"model: random-init Llama, {params / 1e6:.0f}M parameters (hidden 1024, {results[0]['layers']} layers), "
             f"{ranks}, seq_len {shape['seq_len']}, global batch {shape['global_batch']}, {steps} steps, a save at "
             f"step {steps // 2} "
             f"(mid-run: training goes on while an async one is written) and at step {steps} (the end of training "
             f"waits for it)", "",
             "| backend | save | checkpoint GiB | step s | blocking s | persist s | blocking at the end s | "
             "persist at the end s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    def mode(r: dict) -> str:
        return f"sync in the async save's format ({SAME_FORMAT})" if r["same_format"] else \
            "async" if r["async"] else "sync"

    for r in results:
        if "failed" in r:
            lines.append(f"| {BACKENDS[r['backend']].label} | {mode(r)} | failed: {r['failed']} | | | | | |")
            continue
        lines.append(f"| {BACKENDS[r['backend']].label} | {mode(r)} | "
                     f"{r['bytes'] / 2**30:.2f} | {r['step_s']:.2f} | {r['blocking_s']:.2f} | {r['persist_s']:.2f} | "
                     f"{r['last_blocking_s']:.2f} | {r['last_persist_s']:.2f} |")
    lines.append("")
    for backend in BACKENDS:
        done = [r for r in results if r["backend"] == backend and "failed" not in r]
        sync = next((r for r in done if not r["async"] and not r["same_format"]), None)
        same = next((r for r in done if r["same_format"]), None)
        fast = next((r for r in done if r["async"]), None)
        if sync and fast:
            ratio = fast["blocking_s"] / sync["blocking_s"]
            lines.append(f"{BACKENDS[backend].label}: async blocking / sync blocking {ratio:.2f} (target <= {TARGET}: "
                         f"{'met' if ratio <= TARGET else 'missed'})")
            if same:
                ratio = fast["blocking_s"] / same["blocking_s"]
                lines.append(f"{BACKENDS[backend].label}: async blocking / sync blocking in the same format "
                             f"({SAME_FORMAT}) {ratio:.2f} (target <= {TARGET}: "
                             f"{'met' if ratio <= TARGET else 'missed'})")
        elif sync and BACKENDS[backend].async_save:
            lines.append(f"{BACKENDS[backend].label}: no ratio (the asynchronous run failed, above)")
        elif sync:
            lines.append(f"{BACKENDS[backend].label}: synchronous only (no asynchronous save runs under the HF "
                         f"Trainer here; docs/checkpoints.md, 'Checkpoints that do not stall')")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".md"))
    # saves at steps/2 and steps: 6 steps between them outlast a background write of the 261M model here (~30 s), as
    # a real run's interval (Daly's) outlasts its write; with fewer, the second save waits for the first, and that
    # wait is counted as the first one's pause
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--backends", nargs="+", default=list(RECIPES))
    parser.add_argument("--gpu", action="store_true", help="train on this machine's GPUs, one rank each")
    parser.add_argument("--log-dir", type=Path, help="keep each run's log here")
    parser.add_argument("--modes", nargs="+", choices=("sync", "async", "same-format"), help="only these runs")
    parser.add_argument("--run-timeout", type=float, default=3600, help="seconds a run may take")
    args = parser.parse_args()
    gpus = gpu_count() if args.gpu else 0
    if args.gpu and not gpus:
        sys.exit("checkpoint_stall.py: --gpu: no CUDA GPU on this machine")

    from toolkit.spec.backends import backend_of

    config = model_config(args.layers)
    params = parameters(config)
    results = []
    with tempfile.TemporaryDirectory(prefix="checkpoint-stall-") as tmp:
        for backend in args.backends:
            modes = [(False, False), (True, False)] if backend_of(backend).async_save else [(False, False)]
            if backend == "megatron" and gpus != 1:  # on one rank there is no data-parallel gather to compare
                modes.insert(1, (False, True))
            for asynchronous, same_format in modes:
                if args.modes and ("async" if asynchronous else "same-format" if same_format else "sync") \
                        not in args.modes:
                    continue
                result = {**run(backend, asynchronous, config, args.steps, Path(tmp), same_format, gpus, args.log_dir,
                                      args.run_timeout),
                          "layers": args.layers}
                print(json.dumps(result), flush=True)
                results.append(result)
    text = (f"# Checkpoint stall: synchronous vs asynchronous saves\n\nGenerated by `benchmarks/checkpoint_stall.py`."
            f"\n\n{table(results, params, args.steps, gpus)}")
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
