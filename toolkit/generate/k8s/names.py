"""What a manifest may name: Kubernetes object names, label values and image references, checked before they are
written (the YAML is written by a safe dumper, so these rules are about what the API server would accept, and about
never carrying a line break or a shell word into a container's command)."""

from __future__ import annotations

import re

from toolkit.errors import UserInputError

# RFC 1123 label (namespaces, Services: the pods' DNS names) and subdomain (most objects, PVCs), as
# k8s.io/apimachinery/pkg/util/validation says them. Every pattern here is matched with fullmatch: `$` in re.match
# also matches before a trailing line break, which would then be written into the manifest
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
# the reference grammar of distribution/reference: [host[:port]/]path[:tag][@digest]
IMAGE = re.compile(r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                   r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[\w][\w.-]{0,127})?"
                   r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
# object names: JobSet names its pods <name>-<job>-<job index>-<pod index> and those are DNS labels (63), so the
# job's own name stays well below
MAX_NAME = 40


def object_name(recipe_name: str) -> str:
    """The Kubernetes name of a recipe's job: its run name lower-cased, `_` and `.` as `-` (a recipe name is already
    letters, digits, `.`, `_` and `-`: spec/recipe.py RUN_NAME), cut to MAX_NAME."""
    name = re.sub(r"[^a-z0-9-]", "-", recipe_name.lower())[:MAX_NAME].strip("-")
    return name if name and name[0].isalpha() else f"job-{name}"[:MAX_NAME].rstrip("-")


def checked(value: str, flag: str, rule: re.Pattern, what: str, limit: int) -> str:
    """`value` when it obeys `rule` and fits `limit` characters; else one line naming the flag and what is valid."""
    if not isinstance(value, str) or not value or len(value) > limit or not rule.fullmatch(value):
        raise UserInputError(flag, f"{value!r} is not {what} (at most {limit} characters)")
    return value


def image_reference(value: str, flag: str = "--image") -> str:
    return checked(value, flag, IMAGE, "a container image reference (e.g. registry.example.com/team/trainer:1.0)",
                   500)  # the TrainJob CRD's own maxLength for trainer.image


def namespace(value: str, flag: str = "--namespace") -> str:
    return checked(value, flag, DNS_LABEL, "a namespace name (lower-case letters, digits and '-')", 63)


def claim_name(value: str, flag: str = "--checkpoint-pvc") -> str:
    return checked(value, flag, DNS_SUBDOMAIN, "a PersistentVolumeClaim name (lower-case letters, digits, '-', '.')",
                   253)


def queue_name(value: str, flag: str = "--queue") -> str:
    return checked(value, flag, LABEL_VALUE, "a Kueue LocalQueue name usable as a label value (letters, digits, "
                                             "'-', '_', '.')", 63)
