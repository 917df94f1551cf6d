"""The recipe's `cluster:` section (where it trains, with its Kubernetes settings) and its `plan:` section (how the
work is split across the cluster), the latter derived from PlanOptions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model, field_validator, model_validator

from toolkit.errors import UserInputError
from toolkit.numeric import FINITE
from toolkit.spec.cluster import DEFAULT_GPU, get_gpu, load_catalogue
from toolkit.spec.options import PlanOptions, ScaleOut, default, default_text, recipe_key
from toolkit.spec.recipe_data import Section


class K8sSection(Section):
    """Kubernetes: what `dmt generate` and `dmt k8s render` put in the manifests (the flags of `dmt k8s render`
    override them)."""

    image: str | None = Field(None, description="Container image holding the toolkit and this project at /workspace; "
                                                "when set, `dmt generate` also writes k8s-trainjob.yaml.")


class ClusterSection(Section):
    gpus: int = Field(gt=0, description="Total GPUs (CPU processes on a machine without GPUs).")
    gpus_per_node: int = Field(default("gpus_per_node"), gt=0, description="GPUs (processes) per node (default: the "
                                                                         "GPU's in the catalogue, 4 on GB200/GB300, "
                                                                         "else 8).")
    nvlink_domain: int | None = Field(None, gt=0, description="GPUs on one NVLink/NVSwitch fabric, whole nodes "
                                                              "(default: the GPU's, 72 on GB200/GB300 NVL72, else "
                                                              "the node).")
    network: ScaleOut = Field(default("network"), description="The scale-out network between NVLink domains: "
                                                              "infiniband, roce or ethernet (toolkit/estimate/comm.py "
                                                              "holds each one's bandwidth, efficiency and latency).")
    gpu: str = Field(DEFAULT_GPU, description="GPU from the catalogue, for the memory estimate and the planner.")
    nodes: int | None = Field(None, gt=0, description="Defaults to gpus / gpus_per_node, at least 1.")
    accelerator: Literal["gpu", "cpu"] = Field("gpu", description="cpu: gloo processes, as the tests and demo run.")
    host_memory_gb: float | None = Field(None, gt=0, description="RAM of one node in GiB: a plan whose offload (ZeRO, "
                                                                 "CPUOffloadPolicy, activations) needs more does not fit.")
    calibration: str | None = Field(None, description="A calibration file `dmt calibrate` wrote for cluster.gpu "
                                                      "(relative to the recipe): the plan's predictions use it.")
    k8s: K8sSection = Field(K8sSection(), description="Kubernetes manifests (dmt k8s render, dmt generate).")

    @model_validator(mode="before")
    @classmethod
    def _catalogue_node(cls, data):
        """A GPU whose catalogue node is not 8 GPUs (GB200/GB300 trays of 4) sets gpus_per_node when it is unset."""
        if isinstance(data, dict) and data.get("gpus_per_node") is None and isinstance(data.get("gpu"), str):
            gpu = load_catalogue().get(data["gpu"].lower())
            if gpu is not None and not gpu.host:
                return {**data, "gpus_per_node": gpu.gpus_per_node_default}
        return data

    @field_validator("gpu")
    @classmethod
    def _in_catalogue(cls, name: str) -> str:
        try:
            get_gpu(name)
            return name
        except UserInputError as exc:  # pydantic words it as the key's error: `cluster.gpu: unknown GPU ...`
            raise ValueError(exc.message) from None

    @property
    def num_nodes(self) -> int:
        return self.nodes or max(1, -(-self.gpus // self.gpus_per_node))


class _PlanBase(BaseModel):
    """The plan section takes each option's own strictness from PlanOptions (integers strict; a YAML list is a
    tuple of recompute modules)."""

    model_config = ConfigDict(extra="forbid", **FINITE)


def _plan_section() -> type[BaseModel]:
    """The recipe's `plan:` section, derived from PlanOptions: every option a recipe keeps under `plan:`, unset (None)
    by default, so the planner (`auto: true`) or the option's own default fills it."""
    fields: dict = {"auto": (StrictBool, Field(False, description="Let the planner choose every option left unset."))}
    for name, info in PlanOptions.model_fields.items():
        if recipe_key(name) == f"plan.{name}":
            annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
            fields[name] = (annotation | None, Field(None, description=f"{info.description} (default: "
                                                                      f"{default_text(name)})"))
    return create_model("PlanSection", __base__=_PlanBase, __doc__=(
        "Options of the parallel plan (toolkit.spec.options.PlanOptions); seq_len and global_batch come from "
        "`training`, gpus_per_node from `cluster`. With `auto: true` the planner picks every option left unset "
        "(`plan: auto` is short for `{auto: true}` over every backend)."), **fields)


PlanSection = _plan_section()
