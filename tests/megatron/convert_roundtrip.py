"""Run by test_megatron_convert.py in a fresh process: for each family, a tiny random HF model (vocabulary 300, so
Megatron pads it) goes HF -> Megatron-Core dist checkpoint (`--tp/--pp` layouts) -> HF through the converter's own
functions; writes, per family and layout, whether every tensor came back bit for bit."""

import argparse
import json
from pathlib import Path

from mcore_vs_hf import FAMILIES, tiny_model


def bitwise_equal(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in name, dtype, shape or any byte."""
    import torch

    bad = sorted(set(a) ^ set(b))
    for name in set(a) & set(b):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            bad.append(name)
    return bad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--cases", required=True, help="family:tp:pp[:ep[:etp]],...")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    from toolkit.backends.megatron.convert import hf_to_megatron, megatron_to_hf

    results = {}
    for case in args.cases.split(","):
        family, tp, pp, *experts = case.split(":")
        ep, etp = (int(experts[0]) if experts else 1), (int(experts[1]) if len(experts) > 1 else None)
        hf_dir = args.work / family / "hf"
        if not hf_dir.is_dir():
            torch.manual_seed(0)
            config = dict(FAMILIES[family], vocab_size=300)
            tiny_model(config).save_pretrained(hf_dir)
        layout = f"tp{tp}-pp{pp}" + "".join(f"-{k}{v}" for k, v in (("ep", ep), ("etp", etp)) if v not in (1, None))
        mcore, back = args.work / family / f"mcore-{layout}", args.work / family / f"back-{layout}"
        conversion = hf_to_megatron(hf_dir, mcore, tp=int(tp), pp=int(pp), ep=ep, etp=etp)
        megatron_to_hf(mcore, back)
        original, returned = load_file(hf_dir / "model.safetensors"), load_file(back / "model.safetensors")
        results[case] = {"differing": bitwise_equal(original, returned), "tensors": len(original),
                         "layout": json.loads((mcore / "dmt_manifest.json").read_text())["layout"],
                         "padded_vocab": conversion.padded_vocab,
                         "config_equal": json.loads((back / "config.json").read_text()) ==
                                         json.loads((hf_dir / "config.json").read_text())}
    (args.work / "roundtrip.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
