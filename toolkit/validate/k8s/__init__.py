"""Kubernetes manifests (as `dmt k8s render` or `dmt generate` writes them, or by hand) checked offline: against the
operators' own CRD schemas and CEL rules (schemas.py), the releases they name (versions.py) and the plan's rules
(manifests.py). What renders them is toolkit/generate/k8s/."""
