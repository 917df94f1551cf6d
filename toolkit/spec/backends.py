"""The training backends the toolkit knows, declared as data, and the registry the rest of the toolkit walks.

Each declaration names a package `toolkit/backends/<name>/` holding its parts (toolkit/spec/backend.py says which);
the planner, generators, validators, the checkpoint tools and train.py walk `BACKENDS` and reach a backend's code
through its parts' attributes, never by comparing its name. Adding a backend is one package plus one declaration
below."""

from __future__ import annotations

from toolkit.spec.backend import Backend

DEEPSPEED = Backend(name="deepspeed", label="DeepSpeed", hf_modules=True, default_zero=1,
                    launchers=("deepspeed", "accelerate", "torchrun"), conversion="zero-to-hf",
                    files=("deepspeed.json", "accelerate.yaml", "trainer_args.json"),
                    in_process_refused="deepspeed.initialize called again reuses the process groups "
                                       "deepspeed.utils.groups keeps from the first call, destroyed by then, while "
                                       "a spare makes new ones: the restart fails or waits")
MEGATRON = Backend(name="megatron", label="Megatron-Core", hf_modules=False, default_zero=0, launchers=("torchrun",),
                   conversion="megatron-to-hf", files=("megatron.yaml", "megatron_args.txt"), async_save=True,
                   in_process_restart=True, local_checkpoints=True)
FSDP = Backend(name="fsdp", label="FSDP2", hf_modules=True, default_zero=0, launchers=("accelerate", "torchrun"),
               conversion="fsdp-to-hf", files=("accelerate.yaml", "trainer_args.json"), article="an",
               async_save=True, in_process_restart=True)

BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (DEEPSPEED, MEGATRON, FSDP)}
NAMES: tuple[str, ...] = tuple(BACKENDS)


def backend_of(plan) -> Backend:
    """The backend a plan (or anything with a `backend` name, or the name itself) trains with."""
    return BACKENDS[plan if isinstance(plan, str) else plan.backend]
