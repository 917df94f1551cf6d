"""Kubernetes: the resolved plan as a Kubeflow TrainJob, a JobSet or a PyTorchJob (render.py), and those manifests
checked offline against the operators' own CRD schemas and the plan's rules (schemas.py, validate.py).

Like a backend's package, this one is a slice through the layers (tests/unit/test_layering.py K8S_PARTS): what
renders sits beside the generators, what checks beside the validators. The CRDs are data vendored under crds/, with
the release and commit each comes from in crds/sources.json (scripts/vendor_crds.py re-vendors them)."""
