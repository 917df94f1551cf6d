"""Check a Kubernetes manifest (a TrainJob, a JobSet or a PyTorchJob, as `dmt k8s render` writes them or by hand)
offline; `dmt validate` hands it such files and prints `FILE: kind name: key: message` per problem, exit 2 when any."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace, documents: list[dict]) -> int:
    from toolkit.cli.validate import report
    from toolkit.k8s.validate import validate_manifest
    from toolkit.k8s.vendored import SCHEMAS, release

    problems = validate_manifest(documents, args.world_size)
    if problems or args.json:
        return report(args, problems)
    checked = {SCHEMAS[(d["apiVersion"], d["kind"])]: d["kind"] for d in documents}
    against = "; ".join(f"{kind} of {release(file_name)}" for file_name, kind in checked.items())
    print(f"{args.file}: valid ({against}); submit it with `kubectl apply -f {args.file}`")
    return 0
