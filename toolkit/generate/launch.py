"""launch.sh, rendered from launch_templates/ (as slurm.py renders slurm_templates/): the deepspeed / accelerate /
torchrun commands that train a generated plan, on one node or on each of several. Every launcher runs
`toolkit/train.py --plan plan.json`: the files beside the script, never a re-resolution."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from string import Template

from toolkit.generate.ft_launcher import nic_monitor_flag
from toolkit.spec.backends import backend_of
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe

FT_LAUNCHER = "ft_launcher"  # NVIDIA Resiliency Extension's torchrun drop-in (toolkit/generate/ft_launcher.py)
# launch.sh.tmpl, with a case per launcher from single_node/ or multi_node/ (package data: pyproject.toml)
TEMPLATES = Path(__file__).resolve().parent / "launch_templates"


@dataclass(frozen=True)
class LaunchVariable:
    """One environment variable a launch sets, with the reason the generated file states beside it."""

    name: str
    value: str
    reason: str
    default_only: bool = False  # a value the launching environment already has wins (a shell's ${NAME:-value})


def job_variables(recipe: Recipe) -> list[LaunchVariable]:
    """The NCCL / torch.distributed defaults every multi-node job sets (slurm.sbatch exports them, the Kubernetes
    manifests put them in each container's env), each with its reason."""
    variables = [
        LaunchVariable("NCCL_ASYNC_ERROR_HANDLING", "1", "a failed collective ends the job instead of hanging it"),
        LaunchVariable("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "the same switch under its current torch name"),
        LaunchVariable("TORCH_NCCL_BLOCKING_WAIT", "0", "keep the watchdog thread, not blocking waits, for timeouts"),
        LaunchVariable("NCCL_DEBUG", "WARN", "warnings in the job log without per-call noise", default_only=True),
        LaunchVariable("OMP_NUM_THREADS", "1" if _cpu(recipe) else "8",
                       "no CPU oversubscription by dataloader/optimizer threads", default_only=True),
        LaunchVariable("PYTHONUNBUFFERED", "1", "logs arrive as they happen"),
    ]
    if _cpu(recipe):
        variables.append(LaunchVariable("CUDA_VISIBLE_DEVICES", "", "CPU recipe: gloo ranks"))
    return variables


def plan_variables(plan: Plan) -> list[LaunchVariable]:
    """The variables the plan needs at launch (Megatron-Core's with TP or CP: toolkit/backends/megatron/generate.py),
    and NCCL's multi-node NVLink switches where its NVLink domain spans nodes."""
    variables = [LaunchVariable(name, value, reason)
                 for name, (value, reason) in backend_of(plan).generate.launch_variables(plan).items()]
    return variables + multi_node_nvlink_variables(plan)


def spans_nodes_on_nvlink(plan: Plan) -> bool:
    """Whether the plan's ranks on different nodes share an NVLink domain (several nodes of one NVL72 rack)."""
    return plan.nvlink_domain > plan.gpus_per_node and plan.gpus > plan.gpus_per_node


def multi_node_nvlink_variables(plan: Plan) -> list[LaunchVariable]:
    """NCCL's multi-node NVLink (MNNVL) settings for a plan whose NVLink domain spans nodes (NCCL environment
    variables, https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html; GB200 MNNVL needs NCCL 2.25.2 or
    later, https://docs.nvidia.com/multi-node-nvlink-systems/multi-node-tuning-guide/nccl.html). The values the
    launching environment has win (a site's own tuning)."""
    if not spans_nodes_on_nvlink(plan):
        return []
    return [
        LaunchVariable("NCCL_MNNVL_ENABLE", "1", "ranks of different nodes in one NVLink domain talk over NVLink, not "
                                                 "the network (multi-node NVLink)", default_only=True),
        LaunchVariable("NCCL_CUMEM_ENABLE", "1", "MNNVL shares buffers through cuMem fabric handles",
                       default_only=True),
    ]


def export_lines(variables: list[LaunchVariable]) -> str:
    """`export NAME=value  # reason` lines for a bash script (values quoted as one word)."""
    lines = []
    for variable in variables:
        value = shlex.quote(variable.value)
        value = f'"${{{variable.name}:-{variable.value}}}"' if variable.default_only else value
        lines.append(f"export {variable.name}={value}  # {variable.reason}\n")
    return "".join(lines)


def launch_environment(plan: Plan) -> str:
    """The exports of the plan's own variables (plan_variables), as launch.sh and slurm.sbatch set them."""
    return export_lines(plan_variables(plan))


def preflight_flags(recipe: Recipe) -> list[str]:
    """`dmt health`'s flags when a job checks its ranks before training (slurm.sbatch's srun step, the Kubernetes
    manifests' preflight). CPU recipes: the ranks share cores with each other and with the rest of the machine, so a
    matmul 2x slower than the median is noise there, not a bad device; the preflight still checks liveness and
    correctness."""
    sizes = ["--sizes", "1K,1M", "--straggler-factor", "10"] if _cpu(recipe) else ["--sizes", "1M,64M,256M"]
    return [*sizes, "--deadline-s", "60"]


def _cpu(recipe: Recipe) -> bool:
    return recipe.cluster.accelerator == "cpu"


def launch_script(recipe: Recipe, plan: Plan, recipe_path: str) -> str:
    nodes = recipe.cluster.num_nodes
    per_node = plan.gpus // nodes
    launchers = backend_of(plan).launchers  # Megatron-Core: torchrun; FSDP2: accelerate or torchrun
    if recipe.training.restart == "in_process":  # ranks and spares as processes of their own (one node)
        launchers = ("inprocess", *launchers)
    if "torchrun" in launchers:  # NVRx's torchrun drop-in, wherever torchrun runs the plan (ft_config.yaml)
        launchers = (*launchers, FT_LAUNCHER)
    values = dict(name=recipe.name, gpus=plan.gpus, nodes=nodes, per_node=per_node, last_node=nodes - 1,
                  recipe=shlex.quote(recipe_path),
                  backend=plan.backend, spares=recipe.training.spare_ranks, launchers="|".join(launchers),
                  default_launcher=launchers[0], ft_nic_monitor=nic_monitor_flag(recipe),
                  environment=launch_environment(plan), max_restarts=recipe.training.max_restarts,
                  multi_note="\n# Several nodes: run it on each with NODE_RANK and MASTER_ADDR set (and HOSTFILE for "
                             "deepspeed)." if nodes > 1 else "")
    cases = TEMPLATES / ("multi_node" if nodes > 1 else "single_node")
    values["node_checks"] = _render(cases / "node_checks.tmpl", values) if nodes > 1 else ""
    values["cases"] = "".join(_render(cases / f"{launcher}.tmpl", values) for launcher in launchers)
    return _render(TEMPLATES / "launch.sh.tmpl", values)


def _render(template: Path, values: dict) -> str:
    return Template(template.read_text()).substitute(values)
