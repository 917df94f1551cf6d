"""A manifest checked offline against its operator's own CRD, as the API server would on create: the openAPIV3Schema
with unknown fields refused (an object with declared properties takes no others, as `kubeconform --strict` reads
CRDs; `x-kubernetes-preserve-unknown-fields` keeps a subtree open), then every `x-kubernetes-validations` CEL rule
(cel-python) on the values it guards. Transition rules (those reading `oldSelf`) only judge updates and are skipped.
"""

from __future__ import annotations

import functools

from toolkit.generate.k8s.names import DNS_LABEL, DNS_SUBDOMAIN
from toolkit.generate.k8s.vendored import SCHEMAS, crd

# ObjectMeta as a client may send it (the CRDs say only `type: object`; the API server checks it itself)
OBJECT_META = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN.pattern},
    "generateName": {"type": "string"}, "namespace": {"type": "string", "maxLength": 63, "pattern": DNS_LABEL.pattern},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    "finalizers": {"type": "array", "items": {"type": "string"}},
    "ownerReferences": {"type": "array", "items": {"type": "object"}}}}


def _strict(node):
    """The schema as jsonschema reads it, with Kubernetes' structural rules: unknown fields refused, `nullable`."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    strict = {key: _strict(value) for key, value in node.items()}
    if strict.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    if node.get("nullable") and "type" in node:
        strict["type"] = [node["type"], "null"]
    return strict


@functools.cache
def strict_schema(file_name: str) -> dict:
    schema = _strict(crd(file_name)["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


@functools.cache
def _validator(file_name: str):
    import jsonschema

    # Kubernetes' structural schemas are OpenAPI v3.0: draft 4's keywords (a boolean exclusiveMinimum)
    return jsonschema.Draft4Validator(strict_schema(file_name))


def dotted(path) -> str:
    """A JSON path as the dotted key the user edits: spec.trainer.env[2].name."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(the document)"


def schema_problems(document: dict, file_name: str) -> list[tuple[str, str]]:
    """(dotted key, message) for every place the document breaks its CRD's schema, the shallowest first."""
    problems = []
    errors = _validator(file_name).iter_errors(document)
    for error in sorted(errors, key=lambda e: (len(e.path), list(map(str, e.path)))):
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            known = set(error.schema.get("properties", {}))
            for field in sorted(set(error.instance) - known):
                problems.append((dotted([*error.path, field]), "unknown field (the CRD does not declare it)"))
            continue
        problems.append((dotted(error.path), error.message))
    return problems


@functools.cache
def _program(rule: str):
    import celpy

    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def _cel_rules(schema: dict):
    return [rule for rule in schema.get("x-kubernetes-validations", []) if "oldSelf" not in rule["rule"]]


def cel_problems(document: dict, file_name: str) -> list[tuple[str, str]]:
    """(dotted key, message) for every CEL rule of the CRD that the document's values break."""
    import celpy

    problems: list[tuple[str, str]] = []
    stack = [(crd(file_name)["openAPIV3Schema"], document, [])]
    while stack:
        schema, value, path = stack.pop()
        if value is None:
            continue
        for rule in _cel_rules(schema):
            try:
                ok = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
            except Exception as exc:  # a rule that cannot be evaluated on this value (the API server would refuse)
                ok = f"cannot evaluate ({type(exc).__name__})"
            if ok is not True and not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
                problems.append((dotted(path), rule.get("message") or f"fails the rule {rule['rule']}"))
        if isinstance(value, dict):
            for key, child in value.items():
                sub = schema.get("properties", {}).get(key)
                if sub is None and isinstance(schema.get("additionalProperties"), dict):
                    sub = schema["additionalProperties"]
                if sub is not None:
                    stack.append((sub, child, [*path, key]))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            stack.extend((schema["items"], child, [*path, index]) for index, child in enumerate(value))
    return problems


def crd_file(document: dict) -> str | None:
    """The vendored CRD of a document's apiVersion and kind; None when none is vendored for that pair."""
    return SCHEMAS.get((document.get("apiVersion"), document.get("kind")))
