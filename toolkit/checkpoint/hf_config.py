"""The HF config.json a conversion writes beside its weights: found, read, and checked against the tensors.

A converter copies the config next to the weights it writes; a config of another model (a `--config` mistaken, a
parent directory's config.json) gives a directory that `from_pretrained` refuses or, worse, loads with some weights
left random. So a config that did not come with the checkpoint is checked against the tensors before anything is
written: transformers builds its model on the meta device (shapes, no memory) and every tensor name and shape must
be that model's.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import UserInputError
from toolkit.readers import one_line, open_regular, read_json

# Files next to an HF Trainer checkpoint that from_pretrained users expect to travel with the weights.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
WHAT = "an HF config.json (a JSON object whose model_type names the architecture, e.g. llama)"


def found_side_files(folders: list[Path], checkpoint: Path, key: str, names=SIDE_FILES) -> dict[str, Path]:
    """The side files a converter will carry into its output (each name from the first of `folders` holding it),
    each checked before any weight is written: a regular file inside the checkpoint, or one line naming it (a
    tokenizer.json linked to a file elsewhere is refused at once, not after minutes of conversion)."""
    found = {}
    for name in names:
        path = next((folder / name for folder in folders if (folder / name).is_file()), None)
        if path is not None:
            open_regular(path, key, "a side file of the checkpoint", checkpoint).close()
            found[name] = path
    return found


def copy_side_file(path: Path, target: Path, checkpoint: Path, key: str) -> None:
    """Copy a side file found in a checkpoint into the conversion's output, through the one opener: a regular file
    inside the checkpoint (a tokenizer.json linked to a file elsewhere would carry that file into the output)."""
    import shutil

    with open_regular(path, key, "a side file of the checkpoint", checkpoint) as handle, open(target, "wb") as out:
        shutil.copyfileobj(handle, out)


def config_file(path: Path) -> Path:
    """`path` itself, or the config.json inside it when it is a directory."""
    return path / "config.json" if path.is_dir() else path


def read_hf_config(path: Path, flag: str) -> dict:
    """The config.json at `path` (a file or a model directory); `flag` names it in errors."""
    path = config_file(path)
    if not path.exists():
        raise UserInputError(flag, f"{path} not found: an HF model directory holds config.json")
    config = read_json(path, flag, what=WHAT)
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise UserInputError(flag, f"{path} has no model_type; expected {WHAT}")
    return config


def find_config(ckpt_dir: Path, tag_dir: Path, config: Path | None) -> tuple[Path, bool]:
    """The config.json of a DeepSpeed checkpoint and whether it came with the checkpoint (saved in its directory
    by the run, so it is the weights' own; `--config` or the parent directory's may describe another model)."""
    if config is not None:
        path = config_file(config)
        if not path.is_file():
            raise UserInputError("--config", f"{config} is not an HF config.json or a directory with one")
        return path, False
    for candidate in (tag_dir / "config.json", ckpt_dir / "config.json"):
        if candidate.is_file():
            return candidate, True
    if (ckpt_dir.parent / "config.json").is_file():
        return ckpt_dir.parent / "config.json", False
    raise UserInputError("--config", f"no config.json next to {ckpt_dir}; pass --config PATH/config.json")


def meta_model_shapes(hf_config: dict, flag: str) -> tuple[dict[str, tuple], set[str]]:
    """The state dict shapes of the model transformers builds from `hf_config` (on the meta device) and the names
    that are tied to an earlier one (lm_head.weight under tie_word_embeddings)."""
    import torch
    import transformers

    config_fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its warnings about the config are not this check's findings
    try:
        config = transformers.AutoConfig.for_model(hf_config["model_type"], **config_fields)
        names = hf_config.get("architectures")
        known = [getattr(transformers, n) for n in names if hasattr(transformers, n)] if isinstance(names, list) else []
        build = known[0] if known else transformers.AutoModelForCausalLM.from_config  # the class HF will load
        with torch.device("meta"):
            model = build(config)
    except Exception as exc:  # transformers raises ValueError, KeyError, TypeError... for configs it cannot build
        raise UserInputError(flag, f"transformers cannot build a model from it ({type(exc).__name__}: "
                                   f"{one_line(exc)[:200]}); expected {WHAT}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    first: dict[int, str] = {}
    tied = {name for name, p in model.named_parameters(remove_duplicate=False) if first.setdefault(id(p), name) != name}
    return shapes, tied


def check_tensors_match(hf_config: dict, config_path: Path, tensors: dict[str, tuple], flag: str) -> None:
    """Every tensor (name -> shape) must be one of the config's model, with its shape, and every tensor of that
    model must be there (tied ones excepted): a UserInputError at `flag` naming the first that is not."""
    shapes, tied = meta_model_shapes(hf_config, flag)
    model = f"the {hf_config['model_type']} model of {config_path}"
    for name, shape in tensors.items():
        if name not in shapes:
            raise UserInputError(flag, f"the checkpoint holds {name} {shape}, which {model} does not have; pass the "
                                       f"checkpoint's own config.json")
        if tuple(shapes[name]) != tuple(shape):
            raise UserInputError(flag, f"the checkpoint's {name} is {tuple(shape)}, {model} has "
                                       f"{tuple(shapes[name])}; pass the checkpoint's own config.json")
    missing = sorted(set(shapes) - set(tensors) - tied)
    if missing:
        raise UserInputError(flag, f"{model} has {len(missing)} tensor(s) the checkpoint lacks, e.g. {missing[0]}; "
                                   f"pass the checkpoint's own config.json")
