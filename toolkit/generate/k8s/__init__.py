"""Kubernetes manifests of a resolved plan: a Kubeflow TrainJob, a JobSet or a PyTorchJob (render.py), with their
names (names.py), shared-memory sizing (shm.py) and the operators' files vendored under crds/ (vendored.py; the
release and commit of each in crds/sources.json, scripts/vendor_crds.py re-vendors them). Their checks are in
toolkit/validate/k8s/."""
