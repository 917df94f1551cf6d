"""Render the sbatch templates (slurm_templates/) for a recipe: rendezvous, NCCL defaults, preflight, resume,
requeue."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from string import Template

from toolkit.errors import UserInputError
from toolkit.generate.ft_launcher import nic_monitor_flag
from toolkit.generate.launch import FT_LAUNCHER, export_lines, job_variables, launch_environment, preflight_flags
from toolkit.spec.backends import backend_of
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe

TEMPLATES = Path(__file__).resolve().parent / "slurm_templates"  # package data (pyproject.toml)
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")  # partition/account (lists); nothing that breaks a line


# launcher -> what the script's comment says about it
LAUNCHERS = {
    "torchrun": "one torchrun per node (HF Trainer + DeepSpeed or FSDP2, or Megatron-Core), meeting at node 0 through torchrun's "
                "c10d rendezvous, which also serves its restarts of a failed job (training.max_restarts) inside the "
                "allocation, each with a new store (pytorch/pytorch#135712); variables expanded in each task's own "
                "environment (single quotes).",
    "ft_launcher": "one NVIDIA Resiliency Extension ft_launcher (torchrun's drop-in) per node (torchrun's rendezvous and restarts), with "
                   "a rank monitor per rank that ends a rank whose heartbeats stop (timeouts: ft_config.yaml of `dmt "
                   "generate`) for an in-job restart.",
    "accelerate": "one `accelerate launch` per node; machine rank from each task's own environment (single quotes: "
                  "expanded there).",
    "deepspeed": "a hostfile from the allocation, then one `deepspeed --no_ssh` per node with its own node rank "
                 "(single quotes: expanded there).",
}


def sbatch_word(text: str, flag: str) -> str:
    """One word of an #SBATCH line as sbatch reads it: double quotes, backslash escapes; a line break cannot be one."""
    if "\n" in text or "\r" in text:
        raise UserInputError(flag, f"{text!r} holds a line break, which an #SBATCH line cannot carry")
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("#", "\\#")  # an unescaped # starts a comment
    return f'"{escaped}"'


def nvlink_segment(plan: Plan, nodes: int, per_node: int) -> int | None:
    """Slurm's --segment for a plan whose NVLink domain spans nodes (an NVL72 rack of 18 4-GPU nodes): the nodes of
    the job that must come from one topology/block block (one rack), so the groups the plan keeps on NVLink are on
    NVLink. The whole job when it fits one domain, else the largest divisor of the job's nodes that does, as
    Megatron-Bridge's Slurm launcher picks it (scripts/performance/utils/executors.py slurm_executor: at most 18
    nodes on GB200). None where the domain is the node (nothing to keep together)."""
    if not (plan.nvlink_domain > per_node and nodes > 1):
        return None
    domain_nodes = max(1, plan.nvlink_domain // per_node)
    return max(d for d in range(1, min(nodes, domain_nodes) + 1) if nodes % d == 0)


def slurm_log_dir(recipe: Recipe, output_dir: str | None) -> Path:
    """Where job logs go: beside the training output (it must exist before sbatch opens the log)."""
    return Path(output_dir or f"runs/{recipe.name}").resolve().parent / "slurm-logs"


def render_sbatch(
    recipe: Recipe,
    plan: Plan,
    recipe_path: Path,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    partition: str | None = None,
    time_limit: str = "24:00:00",
    account: str | None = None,
    output_dir: str | None = None,
    deepspeed_json: str | None = None,
    kind: str = "train",
    train_flags: list[str] | None = None,
    launcher: str = "torchrun",
    accelerate_config: str | None = None,
    ft_config: str | None = None,
) -> str:
    """`train_flags` (plan overrides such as --zero 3) go to every toolkit/train.py launch of the job; `launcher`
    picks slurm_templates/launch/<launcher>.tmpl (torchrun for every backend; accelerate for the HF Trainer backends,
    deepspeed for DeepSpeed)."""
    nodes = recipe.cluster.num_nodes if nodes is None else nodes
    if nodes < 1:
        raise UserInputError("--nodes", f"must be at least 1, got {nodes}")
    # a job smaller than a node takes the GPUs it needs, not the node's count
    per_node = (min(recipe.cluster.gpus_per_node, max(1, plan.gpus // nodes)) if gpus_per_node is None
                else gpus_per_node)
    if per_node < 1:
        raise UserInputError("--gpus-per-node", f"must be at least 1, got {per_node}")
    if nodes * per_node != plan.gpus:
        raise UserInputError("--nodes", f"{nodes} x {per_node} GPUs = {nodes * per_node}, the plan needs {plan.gpus}; "
                                        f"use --nodes {max(1, plan.gpus // per_node)} or change the recipe")
    if not _TIME.fullmatch(time_limit):
        raise UserInputError("--time", f"{time_limit!r} is not a Slurm time (e.g. 24:00:00 or 2-00:00:00)")
    for flag, value in (("--partition", partition), ("--account", account)):
        if value is not None and not _NAME.fullmatch(value):
            raise UserInputError(flag, f"{value!r} is not a Slurm name (letters, digits, _ . - and commas between names)")
    backend = backend_of(plan)
    if deepspeed_json and "deepspeed.json" not in backend.files:
        raise UserInputError("--deepspeed", f"is a DeepSpeed option; this recipe trains with the {plan.backend} "
                                            f"backend")
    if launcher not in LAUNCHERS:
        raise UserInputError("--launcher", f"'{launcher}': use one of {', '.join(LAUNCHERS)}")
    if kind == "convert" and backend.conversion is None:
        raise UserInputError("--convert", f"the {plan.backend} backend's checkpoints are HF models already: nothing "
                                          f"to convert")
    if launcher == FT_LAUNCHER and not ft_config:
        raise UserInputError("--launcher", "ft_launcher reads the ft_config.yaml `dmt generate` writes: pass --plan "
                                           "with the generated directory")
    if launcher not in backend.launchers and not (launcher == FT_LAUNCHER and "torchrun" in backend.launchers):
        runs_under = " or ".join(sorted(backend.launchers, reverse=True))  # torchrun first
        raise UserInputError("--launcher", f"the {plan.backend} backend runs under {runs_under}, not {launcher}")
    if launcher == "accelerate" and not accelerate_config:
        raise UserInputError("--accelerate-config", "the accelerate launcher needs the accelerate.yaml that "
                                                    "`dmt generate` writes")
    cpu = recipe.cluster.accelerator == "cpu"
    extra = [f"#SBATCH --partition={partition}"] if partition else []
    extra += [f"#SBATCH --account={account}"] if account else []
    segment = nvlink_segment(plan, nodes, per_node)
    if segment:  # before the option: a comment on an #SBATCH line is Slurm-version dependent
        extra += [f"# the NVLink domain spans {plan.nvlink_domain // per_node} nodes: blocks of {segment} nodes from one "
                  f"rack (TopologyPlugin=topology/block, Slurm 24.05 or later)", f"#SBATCH --segment={segment}"]
    log_dir = slurm_log_dir(recipe, output_dir)
    train_args = ["--recipe", str(recipe_path.resolve())] + (["--deepspeed", str(Path(deepspeed_json).resolve())]
                                                              if deepspeed_json else []) + list(train_flags or [])
    values = dict(
        recipe_name=recipe.name,
        job_name=re.sub(r"[^A-Za-z0-9_.-]", "-", recipe.name),
        nodes=nodes,
        gpus_per_node=per_node,
        world=plan.gpus,
        gpus_per_node_directive=per_node,
        cpus_per_task=(os.cpu_count() or 2) if cpu else 8 * per_node,  # one launcher task per node: all its CPUs
        time_limit=time_limit,
        log_dir=shlex.quote(str(log_dir)),
        # sbatch expands %-patterns in file names: the directory's own % are doubled, %x (job name) and %j (id) kept
        log_file=sbatch_word(str(log_dir).replace("%", "%%") + "/%x-%j.out", "--output-dir"),
        signal_lead_s=120,
        extra_directives="\n".join(extra),
        output_dir=shlex.quote(str(Path(output_dir or f"runs/{recipe.name}").resolve())),
        job_env=export_lines(job_variables(recipe)),
        launch_env=launch_environment(plan),
        health_flags=" ".join(preflight_flags(recipe)),
        python_bin_dir=shlex.quote(str(Path(sys.executable).parent)),
        train_args=" ".join(shlex.quote(arg) for arg in train_args),
        accelerate_config=shlex.quote(str(Path(accelerate_config).resolve())) if accelerate_config else "",
        launcher=launcher,
        ft_config=shlex.quote(str(Path(ft_config).resolve())) if ft_config else "",
        ft_nic_monitor=nic_monitor_flag(recipe),
        launch_comment=LAUNCHERS[launcher],
        max_restarts=recipe.training.max_restarts,
        convert_direction=backend.conversion,
    )
    values["launch"] = Template((TEMPLATES / "launch" / f"{launcher}.tmpl").read_text()).substitute(values).rstrip()
    text = Template((TEMPLATES / f"{kind}.sbatch.tmpl").read_text()).substitute(values)
    if cpu:  # no GRES on CPU partitions
        text = text.replace(f"#SBATCH --gpus-per-node={per_node}\n", "")
    return text
