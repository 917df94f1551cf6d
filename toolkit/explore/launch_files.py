"""`/api/generate`: a ranked plan of `dmt plan` as a minimal recipe, rendered by the toolkit's own generator.

The recipe lives in a temp dir for the length of the request; the texts come back with that dir written as `.`, so
they read as if recipe.yaml and the generated files sat side by side in the user's working directory. Nothing in
the request names a file: the plan holds only the keys of a `dmt plan --json` record's plan, and a calibration comes
as its content (written there as calibration.yaml, which the recipe's cluster.calibration names).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml
from pydantic import BaseModel

from toolkit.cli.train_tokens import parse_token_count
from toolkit.errors import UserInputError, named_as
from toolkit.explore.bridge import as_dot
from toolkit.explore.form import uploaded_file
from toolkit.generate.files import render, resolve
from toolkit.spec.cluster import DEFAULT_GPU
from toolkit.spec.model import preset_names
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe

REQUEST_KEYS = ("model", "gpu", "plan", "train_tokens", "calibration")
PLACEHOLDER_STEPS = 1000  # without --train-tokens: a schedule length for the user to edit
PLACEHOLDER_LR = 3e-4
HEADER = ("# Written by `dmt explore` for the plan it ranked. The data files, learning rate and max_steps are\n"
          "# placeholders: edit them, then `dmt generate recipe.yaml --out DIR` writes these launch files again.\n")


def _sections() -> dict[str, set[str]]:
    """Recipe section -> its field names (toolkit.spec.recipe), to place each key of a plan record."""
    return {name: set(field.annotation.model_fields) for name, field in Recipe.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)}


def plan_recipe(model, gpu: str, plan: dict, train_tokens: int | None) -> dict:
    """A recipe whose resolved plan is `plan` (a `dmt plan --json` record's plan); derived sizes (dp, grad_accum)
    are left for the recipe to derive again."""
    if isinstance(model, dict):
        model_section = {"config": model}
        name = "explore-pasted-config"
    elif isinstance(model, str) and model in preset_names():
        model_section = {"source": model}
        name = f"explore-{model}"
    else:
        raise UserInputError("model", f"a preset name or a pasted HF config.json object, got {model!r}")
    if not isinstance(plan, dict):
        raise UserInputError("plan", "expected the `plan` object of a `dmt plan --json` record")
    unknown = sorted(set(plan) - set(Plan.model_fields))  # e.g. cluster.calibration: a path, which no plan holds
    if unknown:
        raise UserInputError(f"plan.{unknown[0]}", f"not a key of a `dmt plan --json` record's plan; valid: "
                                                   f"{', '.join(Plan.model_fields)}")
    recipe: dict = {"name": name, "model": model_section, "data": {"train_files": ["data/train.jsonl"]},
                    "cluster": {"gpu": gpu}, "training": {"learning_rate": PLACEHOLDER_LR}, "plan": {}}
    sections = _sections()
    for key, value in plan.items():
        section = next((s for s in ("cluster", "training", "plan") if key in sections[s]), None)
        if section is not None and value is not None:
            recipe.setdefault(section, {})[key] = value
    sizes = [plan.get("global_batch"), plan.get("seq_len")]  # of any type here: the recipe's own check refuses them
    tokens_per_step = sizes[0] * sizes[1] if all(type(n) is int and n > 0 for n in sizes) else 0
    recipe["training"]["max_steps"] = (-(-train_tokens // tokens_per_step) if train_tokens and tokens_per_step
                                       else PLACEHOLDER_STEPS)
    return recipe


def launch_files(request: dict) -> dict[str, str]:
    """{file name: text} of every launch file `dmt generate` writes for the plan, plus the recipe itself."""
    if not isinstance(request, dict):
        raise UserInputError("request", "expected a JSON object with model, gpu and plan")
    unknown = sorted(set(request) - set(REQUEST_KEYS))
    if unknown:
        raise UserInputError(unknown[0], f"unknown key; valid: {', '.join(REQUEST_KEYS)}")
    tokens = request.get("train_tokens")
    if tokens not in (None, ""):
        try:
            tokens = parse_token_count(tokens)
        except Exception as exc:  # argparse.ArgumentTypeError: the same message as the flag's
            raise UserInputError("--train-tokens", str(exc)) from None
    recipe = plan_recipe(request.get("model"), request.get("gpu") or DEFAULT_GPU, request.get("plan"),
                         tokens or None)
    with tempfile.TemporaryDirectory(prefix="dmt-explore-") as workdir:
        if request.get("calibration") not in (None, ""):
            recipe["cluster"]["calibration"] = uploaded_file("calibration", request["calibration"], Path(workdir)).name
        path = Path(workdir) / "recipe.yaml"
        text = HEADER + yaml.safe_dump(recipe, sort_keys=False)
        path.write_text(text)
        with named_as({"cluster.calibration": "--calibration"}):  # the upload is what the request calls it
            files = render(resolve(path, Path(workdir)))
        files["recipe.yaml"] = text
        if "calibration" in recipe["cluster"]:  # the file the recipe names, to sit beside it
            files["calibration.yaml"] = request["calibration"]
        return {name: as_dot(body, Path(workdir)) for name, body in files.items()}
