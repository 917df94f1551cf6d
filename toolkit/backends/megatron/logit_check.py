"""`dmt convert check`: the same tokens through the HF model and the Megatron-Core model of a dist checkpoint
(loaded at a chosen TP/PP by Megatron-Core itself); the largest logit difference decides.

With TP x PP > 1 the comparison runs under torchrun (gloo on CPU, nccl on GPUs): every rank builds its part,
Megatron-Core's pipeline schedule runs the forward pass, and the last stage gathers the vocabulary over TP.
Run directly as `python -m toolkit.backends.megatron.logit_check` by that launch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from toolkit.backends.megatron.build import init_distributed
from toolkit.backends.megatron.convert import (
    check_layout,
    checkpoint_vocab,
    hf_weight_map,
    layout_world,
    load_weights,
    megatron_model,
    megatron_model_config,
    single_process_group,
)
from toolkit.checkpoint.hf_config import read_hf_config
from toolkit.checkpoint.safe_load import check_checkpoint
from toolkit.errors import UserInputError
from toolkit.families import megatron_fields
from toolkit.numeric import finite_float
from toolkit.runtime.children import Children
from toolkit.runtime.ports import free_port

BATCH, SEQ = 2, 32


@dataclass
class LogitCheck:
    max_abs_diff: float
    logit_scale: float
    tolerance: float
    tp: int
    pp: int
    ep: int = 1
    etp: int = 1  # the expert layers' TP (attention's without parallel folding)

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def _tokens(hf_config: dict):
    import torch

    sections = megatron_fields(hf_config)
    seq = min(SEQ, sections["gpt_model"].get("max_sequence_length") or SEQ)
    vocab = sections["model"]["vocab_size"]
    return torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(0))


def hf_logits(hf_dir: Path, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def megatron_logits(ckpt: Path, hf_config: dict, tp: int, pp: int, tokens, ep: int = 1, etp: int | None = None):
    """Full-vocabulary logits on the last pipeline stage (None on the other ranks)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    config = megatron_model_config(hf_config, tp=tp, pp=pp, ep=ep, etp=etp, padded_vocab=checkpoint_vocab(ckpt))
    config["transformer_config"]["pipeline_dtype"] = "float32"
    vocab = config["model"]["vocab_size"]
    with megatron_model(config) as model:
        load_weights(model, ckpt)
        model.eval()
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        batch = {"tokens": tokens, "position_ids": positions}

        def forward_step(data_iterator, chunk):
            data = next(data_iterator)
            output = chunk(data["tokens"], data["position_ids"], None)
            return output, lambda out, non_loss_data=True: gather_from_tensor_model_parallel_region(out)

        with torch.no_grad():
            collected = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
                seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True,
                collect_non_loss_data=True)
        if not parallel_state.is_pipeline_last_stage():
            return None
        logits = collected[0]
        if logits.shape[0] != tokens.shape[0]:  # [seq, batch, vocab] from some schedules
            logits = logits.transpose(0, 1)
        return logits[..., :vocab].detach().clone()


def compare(hf_dir: Path, ckpt: Path, tp: int, pp: int, tolerance: float, ep: int = 1,
            etp: int | None = None) -> LogitCheck | None:
    """This rank's part of the comparison; the result on the rank that holds the logits (None elsewhere)."""
    hf_config = read_hf_config(hf_dir, "HF_DIR")
    tokens = _tokens(hf_config)
    got = megatron_logits(ckpt, hf_config, tp, pp, tokens, ep, etp)
    if got is None:
        return None
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1 and not _writer(tp, pp):
        return None
    want = hf_logits(hf_dir, tokens)
    return LogitCheck(float((got - want).abs().max()), float(want.abs().max()), tolerance, tp, pp, ep, etp or tp)


def _writer(tp: int, pp: int) -> bool:
    """The first rank of the last pipeline stage writes (Megatron-Core's rank order: TP fastest, then ..., PP)."""
    import torch.distributed as dist

    return dist.get_rank() == (pp - 1) * (dist.get_world_size() // pp)


def run_check(hf_dir: Path, ckpt: Path, tp: int = 1, pp: int = 1, tolerance: float = 1e-4, ep: int = 1,
              etp: int | None = None) -> LogitCheck:
    """Compare in this process (a layout of one rank) or in a torchrun launch of the layout's ranks (TP x PP, with
    the experts' ETP x EP folded over them: layout_world)."""
    check_layout(read_hf_config(hf_dir, "HF_DIR"), tp, pp, 1, ep, etp)
    world = layout_world(tp, pp, ep, etp)
    hf_weight_map(hf_dir)  # the HF side's weights exist, before any model is built or rank launched
    if not ckpt.is_dir():
        raise UserInputError("MEGATRON_DIR", f"{ckpt} is not a directory")
    check_checkpoint(ckpt, "MEGATRON_DIR")  # refused here, before any model is built or rank launched
    if world == 1:
        with single_process_group():
            return compare(hf_dir, ckpt, tp, pp, tolerance, ep, etp)
    with tempfile.TemporaryDirectory(prefix="dmt-check-") as tmp:
        out = Path(tmp) / "check.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(free_port()), "-m", "toolkit.backends.megatron.logit_check",
               "--hf-dir", str(hf_dir), "--ckpt", str(ckpt), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
               *(("--etp", str(etp)) if etp is not None else ()),
               "--tolerance", str(tolerance), "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with Children(f"the {world}-process logit check") as children:  # torchrun's workers: sessions of their own
            process = children.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            stdout, stderr = process.communicate()
        if not out.is_file():
            raise RuntimeError(f"the {world}-process logit check failed (rc={process.returncode}):\n"
                               f"{stdout[-2000:]}\n{stderr[-3000:]}")
        data = json.loads(out.read_text())
        if "error" in data:
            raise UserInputError(*data["error"])
        return LogitCheck(**data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.backends.megatron.logit_check", allow_abbrev=False)
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--tolerance", type=finite_float, default=1e-4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    init_distributed()
    import torch.distributed as dist

    try:
        result = compare(args.hf_dir, args.ckpt, args.tp, args.pp, args.tolerance, args.ep, args.etp)
    except UserInputError as exc:  # handed to the launching `dmt convert check`, which prints it as one line
        args.out.write_text(json.dumps({"error": [exc.key, exc.message]}))
        result = None
    if result is not None:
        args.out.write_text(json.dumps({k: getattr(result, k) for k in ("max_abs_diff", "logit_scale",
                                                                        "tolerance", "tp", "pp", "ep", "etp")}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
