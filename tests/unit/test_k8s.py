"""Kubernetes manifests (issue 27): every kind renders for every backend's recipe, on CPU and on GPUs, and passes
`dmt validate` against the vendored CRDs and the plan's rules; the classic mistakes are each refused in one line with
exit code 2; nothing a recipe, a flag or a path holds reaches YAML or a shell as anything but one value."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, k8s_training_pod
from toolkit.cli.main import main
from toolkit.generate.k8s.render import KINDS, PET_VARIABLES, make_job, manifest_text
from toolkit.generate.k8s.shm import NCCL_SHM_PER_COMMUNICATOR, quantity_bytes, shm_bytes
from toolkit.planner.recipe import recipe_plan
from toolkit.spec.recipe import load_recipe, recipe_model

IMAGE = "registry.example.com/team/dmt:1.0"
BACKEND_RECIPES = ("tiny-llama-cpu", "tiny-llama-fsdp-cpu", "tiny-llama-megatron-cpu")  # deepspeed, fsdp, megatron
GPU_CLUSTER = "cluster:\n  gpus: 4\n  gpus_per_node: 2\n  nodes: 2\n  gpu: h100-80gb\n"  # 2 nodes x 2 GPUs


def _gpu_variant(text: str) -> str:
    start, end = text.index("cluster:\n"), text.index("training:\n")
    return text[:start] + GPU_CLUSTER + text[end:]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's directory (what the image copies to /workspace): the three backends' tiny recipes, each also as a
    2-node GPU recipe, and their corpus."""
    root = tmp_path_factory.mktemp("project")
    shutil.copytree(ROOT / "recipes" / "data", root / "data")
    for name in BACKEND_RECIPES:
        text = (ROOT / "recipes" / f"{name}.yaml").read_text()
        (root / f"{name}.yaml").write_text(text)
        (root / f"{name}-gpu.yaml").write_text(_gpu_variant(text).replace(f"name: {name}", f"name: {name}-gpu"))
    return root


RECIPES = [*BACKEND_RECIPES, *(f"{name}-gpu" for name in BACKEND_RECIPES)]


@pytest.fixture(scope="module")
def manifests(project) -> dict:
    """Every kind x recipe, rendered once: (recipe, kind) -> (the job, the manifest's documents)."""
    rendered = {}
    for name in RECIPES:
        recipe = load_recipe(project / f"{name}.yaml")
        plan = recipe_plan(recipe, recipe_model(recipe))
        job = make_job(recipe, plan, IMAGE, project / f"{name}.yaml", queue="team-a", cwd=project)
        for kind in KINDS:
            rendered[name, kind] = job, list(yaml.safe_load_all(manifest_text(job, kind)))
    return rendered


def _validate(capsys, tmp_path, documents, *flags) -> tuple[int, list[str]]:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    code = main(["validate", str(path), *flags])
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()] or captured.out.splitlines()


def _job(documents: list[dict]) -> dict:
    return documents[-1]  # the TrainJob follows its TrainingRuntime


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", RECIPES)
def test_every_kind_renders_for_every_backend_and_validates(manifests, capsys, tmp_path, name, kind):
    job, documents = manifests[name, kind]
    code, lines = _validate(capsys, tmp_path, documents)
    assert code == 0 and "valid (" in lines[0], lines
    pod = k8s_training_pod(kind, documents)
    (trainer,) = pod["containers"]
    command = _job(documents)["spec"]["trainer"]["command"] if kind == "trainjob" else trainer["command"]
    # the same training entry as launch.sh, under torchrun for every backend, resuming from the PVC
    assert "toolkit.train" in " ".join(command) and command[-2:] == ["--resume", "auto"]
    assert f"/checkpoints/{job.recipe.name}" in command
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert quantity_bytes(volumes["dshm"]["emptyDir"]["sizeLimit"]) >= shm_bytes(job.plan, job.per_node)
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == f"{job.name}-checkpoints"
    resources = (_job(documents)["spec"]["trainer"].get("resourcesPerNode") if kind == "trainjob"
                 else trainer.get("resources")) or {}
    gpus = {section: resources.get(section, {}).get("nvidia.com/gpu") for section in ("requests", "limits")}
    assert gpus == ({"requests": 2, "limits": 2} if name.endswith("-gpu") else {"requests": None, "limits": None})
    assert _job(documents)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    if kind == "trainjob":
        trainer_spec = _job(documents)["spec"]["trainer"]
        assert trainer_spec["numNodes"] * trainer_spec["numProcPerNode"] == job.plan.gpus
        assert not {e["name"] for e in trainer_spec["env"]} & set(PET_VARIABLES)
        assert _job(documents)["spec"]["runtimeRef"]["name"] == documents[0]["metadata"]["name"]
    preflight = " ".join(" ".join(c.get("command", [])) for c in [*pod.get("initContainers", []), trainer])
    assert "toolkit health" in preflight  # dmt health before training


def test_the_nccl_environment_is_the_slurm_scripts(manifests, project, capsys):
    """One list of NCCL defaults (toolkit/generate/launch.py): slurm.sbatch exports each, every manifest sets each."""
    from toolkit.generate.launch import job_variables

    job, documents = manifests["tiny-llama-cpu-gpu", "jobset"]
    assert main(["slurm", "render", str(project / "tiny-llama-cpu-gpu.yaml")]) == 0
    sbatch = capsys.readouterr().out
    env = {e["name"]: e.get("value") for e in k8s_training_pod("jobset", documents)["containers"][0]["env"]}
    for variable in job_variables(job.recipe):
        assert f"export {variable.name}=" in sbatch and env[variable.name] == variable.value


def test_the_megatron_plan_variables_reach_the_container(project):
    """Megatron-Core with TP: the backend's own launch variable (toolkit/backends/megatron/generate.py)."""
    recipe = load_recipe(project / "tiny-llama-megatron-cpu.yaml")
    plan = recipe_plan(recipe, recipe_model(recipe), tp=2)
    job = make_job(recipe, plan, IMAGE, project / "tiny-llama-megatron-cpu.yaml", cwd=project)
    (document,) = yaml.safe_load_all(manifest_text(job, "pytorchjob"))
    env = {e["name"]: e["value"] for e in k8s_training_pod("pytorchjob", [document])["containers"][0]["env"]}
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_shm_is_sized_for_the_plans_communicators(manifests):
    """33 MB per communicator (the Trainer docs) for each rank of a node: world and every parallel group > 1."""
    job, _ = manifests["tiny-llama-megatron-cpu-gpu", "jobset"]
    groups = 1 + sum(size > 1 for size in (job.plan.dp, job.plan.tp, job.plan.pp, job.plan.cp, job.plan.ep))
    assert shm_bytes(job.plan, 2) >= 2 * groups * NCCL_SHM_PER_COMMUNICATOR
    assert quantity_bytes("512Mi") == 2**29 and quantity_bytes("1G") == 1e9 and quantity_bytes("2e3") == 2000
    assert quantity_bytes("lots") is None
    # past what the API server stores (an int64), or an exponent no float holds: not a quantity, never OverflowError
    assert quantity_bytes("9Ei") is None and quantity_bytes("1e400") is None and quantity_bytes("1e-999") is None
    assert quantity_bytes("1Gi\n") == 2**30  # surrounding blanks are YAML's, not the quantity's


def _env_named(entries: list, name: str, value: str) -> None:
    entries.append({"name": name, "value": value})


def _drop_shm(documents: list[dict]) -> None:
    pod = k8s_training_pod("trainjob", documents)
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "dshm"]
    for container in [*pod["containers"], *pod["initContainers"]]:
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "dshm"]


def _set_gpus(documents: list[dict], count: int) -> None:
    for section in ("requests", "limits"):
        _job(documents)["spec"]["trainer"]["resourcesPerNode"][section]["nvidia.com/gpu"] = count


def _small_shm(documents: list[dict]) -> None:
    for volume in k8s_training_pod("trainjob", documents)["volumes"]:
        if volume["name"] == "dshm":
            volume["emptyDir"]["sizeLimit"] = "64Mi"


MISTAKES = {  # a TrainJob of the GPU recipe edited -> what the one line must say
    "the v2.1 override field": (lambda d: _job(d)["spec"].__setitem__("podTemplateOverrides", [{"targetJobs": [
        {"name": "node"}], "spec": {"nodeSelector": {"a": "b"}}}]), ("spec.podTemplateOverrides", "v2.1",
                                                                      "runtimePatches", "v2.3.0")),
    "the v2.0 override field": (lambda d: _job(d)["spec"].__setitem__("podSpecOverrides", []),
                                ("spec.podSpecOverrides", "v2.0", "runtimePatches")),
    "numProcPerNode auto": (lambda d: _job(d)["spec"]["trainer"].__setitem__("numProcPerNode", "auto"),
                            ("spec.trainer.numProcPerNode", "'auto'", "integer", "v2.0-v2.1")),
    "numProcPerNode 0": (lambda d: _job(d)["spec"]["trainer"].__setitem__("numProcPerNode", 0),
                         ("spec.trainer.numProcPerNode", "0", "positive")),
    "a user-set PET_NNODES": (lambda d: _env_named(_job(d)["spec"]["trainer"]["env"], "PET_NNODES", "4"),
                              ("spec.trainer.env", "PET_NNODES", "injects")),
    "no /dev/shm": (_drop_shm, ("/dev/shm", "64 MB")),
    "a /dev/shm too small": (_small_shm, ("sizeLimit", "'64Mi'", "communicators")),
    "a /dev/shm past any quantity": (lambda d: [v["emptyDir"].__setitem__("sizeLimit", "1e999999999") for v in
                                                k8s_training_pod("trainjob", d)["volumes"] if v["name"] == "dshm"],
                                     ("sizeLimit", "'1e999999999'", "quantity")),
    "an image with a line break": (lambda d: _job(d)["spec"]["trainer"].__setitem__("image", IMAGE + "\n"),
                                   ("spec.trainer.image", "image")),
    "a GPU count off the plan": (lambda d: _set_gpus(d, 4), ("nvidia.com/gpu", "4", "set it to 2")),
    "a node count off the plan": (lambda d: _job(d)["spec"]["trainer"].__setitem__("numNodes", 3),
                                  ("3 node(s)", "world size is 4")),
    "an unknown field": (lambda d: k8s_training_pod("trainjob", d)["containers"][0].__setitem__("volumeMount", []),
                         ("containers[0].volumeMount", "unknown field")),
    "a CEL rule": (lambda d: _job(d)["spec"].__setitem__("managedBy", "me"),
                   ("spec.managedBy", "ManagedBy must be")),
    "no image": (lambda d: [_job(d)["spec"]["trainer"].pop("image"),
                            k8s_training_pod("trainjob", d)["containers"][0].pop("image")],
                 ("spec.trainer.image", "None", "image")),
    "no checkpoint PVC": (lambda d: [v.__setitem__("emptyDir", {}) or v.pop("persistentVolumeClaim")
                                     for v in k8s_training_pod("trainjob", d)["volumes"] if v["name"] == "checkpoints"],
                          ("volumeMounts", "PersistentVolumeClaim")),
    "the wrong apiVersion": (lambda d: _job(d).__setitem__("apiVersion", "kubeflow.org/v1"),
                             ("apiVersion", "trainer.kubeflow.org/v1alpha1")),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_classic_mistake_is_one_line_and_exit_2(manifests, capsys, tmp_path, mistake):
    edit, says = MISTAKES[mistake]
    _, documents = manifests["tiny-llama-cpu-gpu", "trainjob"]
    documents = json.loads(json.dumps(documents))
    edit(documents)
    code, lines = _validate(capsys, tmp_path, documents)
    assert code == 2 and len(lines) == 1, lines
    assert "Traceback" not in lines[0] and all(word in lines[0] for word in says), lines


def test_a_hand_written_manifest_is_checked_against_world_size(manifests, capsys, tmp_path):
    """No plan recorded: --world-size is the plan's world size; without it, the line says so."""
    _, documents = manifests["tiny-llama-fsdp-cpu-gpu", "pytorchjob"]
    documents = json.loads(json.dumps(documents))
    del documents[0]["metadata"]["annotations"]
    assert _validate(capsys, tmp_path, documents, "--world-size", "4")[0] == 0
    code, lines = _validate(capsys, tmp_path, documents, "--world-size", "8")
    assert code == 2 and len(lines) == 1 and "world size is 8" in lines[0], lines
    code, lines = _validate(capsys, tmp_path, documents)
    assert code == 2 and len(lines) == 1 and "--world-size" in lines[0], lines


def test_the_cli_writes_the_manifest_and_prints_the_kubectl_command(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    assert main(["k8s", "render", "tiny-llama-cpu.yaml", "--kind", "pytorchjob", "--image", IMAGE, "--out",
                 "job.yaml", "--namespace", "ml", "--checkpoint-pvc", "team-ckpt"]) == 0
    out = capsys.readouterr().out
    assert "kubectl apply -f" in out and "job.yaml" in out
    (job,) = yaml.safe_load_all((project / "job.yaml").read_text())
    assert job["metadata"]["namespace"] == "ml"
    assert main(["validate", "job.yaml"]) == 0


@pytest.mark.parametrize("flag, value", [("--image", "reg.io/x:1\nkind: Secret"), ("--image", "$(touch PWNED)"),
                                         ("--namespace", "ml; rm -rf /"), ("--checkpoint-pvc", "../ckpt"),
                                         ("--queue", "a\nb: c"),
                                         # `$` of re.match matches before a trailing line break: fullmatch does not
                                         ("--image", "reg.io/x:1\n"), ("--namespace", "ml\n"),
                                         ("--checkpoint-pvc", "ckpt\n"), ("--queue", "q\n")])
def test_a_hostile_name_is_refused_in_one_line(project, capsys, monkeypatch, flag, value):
    monkeypatch.chdir(project)
    argv = ["k8s", "render", "tiny-llama-cpu.yaml", "--kind", "trainjob", "--image", IMAGE, flag, value]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and flag in err[0], err
    assert not list(project.rglob("PWNED"))


def test_a_hostile_path_is_one_argument_in_yaml_and_in_the_shell(project, capsys, monkeypatch, tmp_path):
    """A recipe under a directory named with YAML and shell syntax: every kind carries it as one value, and the
    PyTorchJob's bash -c script receives it as "$@", never as script text."""
    hostile = project / "odd: $(touch PWNED) #\n- x"
    hostile.mkdir()
    text = (project / "tiny-llama-cpu.yaml").read_text().replace("data/tiny_corpus.txt",
                                                                  str(project / "data/tiny_corpus.txt"))
    (hostile / "recipe.yaml").write_text(text)
    monkeypatch.chdir(project)
    for kind in KINDS:
        assert main(["k8s", "render", str(hostile.name) + "/recipe.yaml", "--kind", kind, "--image", IMAGE,
                     "--out", str(tmp_path / f"{kind}.yaml")]) == 0
        documents = list(yaml.safe_load_all((tmp_path / f"{kind}.yaml").read_text()))
        assert len(documents) == (2 if kind == "trainjob" else 1)
        command = (_job(documents)["spec"]["trainer"]["command"] if kind == "trainjob"
                   else k8s_training_pod(kind, documents)["containers"][0]["command"])
        assert f"{hostile.name}/recipe.yaml" in command
    script = command[:3] + ["dmt-train"] + command[4:]  # the PyTorchJob's: bash -c SCRIPT dmt-train ARGS...
    script[2] = script[2].replace("torchrun", "printf '%s\\n'").replace("exec ", "").split("&& ")[-1]
    printed = subprocess.run(script, capture_output=True, text=True, check=True).stdout
    assert f"{hostile.name}/recipe.yaml" in printed and not list(project.rglob("PWNED"))
    capsys.readouterr()


def test_generate_writes_the_trainjob_when_the_recipe_names_an_image(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    text = (project / "tiny-llama-cpu.yaml").read_text().replace("  accelerator: cpu\n",
                                                                 f"  accelerator: cpu\n  k8s:\n    image: {IMAGE}\n")
    (project / "with-image.yaml").write_text(text)
    assert main(["generate", "with-image.yaml", "--out", "gen"]) == 0
    assert main(["validate", "gen/k8s-trainjob.yaml"]) == 0
    trainjob = list(yaml.safe_load_all((project / "gen" / "k8s-trainjob.yaml").read_text()))[-1]
    assert trainjob["spec"]["trainer"]["image"] == IMAGE
    assert trainjob["spec"]["trainer"]["command"][3:7] == ["--recipe", "with-image.yaml", "--plan", "gen/plan.json"]
    assert "k8s-trainjob.yaml" in json.loads((project / "gen" / "plan.json").read_text())["files"]
    assert main(["generate", "tiny-llama-cpu.yaml", "--out", "gen-plain"]) == 0  # no image: no manifest
    assert not (project / "gen-plain" / "k8s-trainjob.yaml").exists()
    capsys.readouterr()


def test_the_vendored_crds_say_where_they_come_from():
    from toolkit.generate.k8s.vendored import CRDS, SCHEMAS, sources

    recorded = sources()
    assert set(SCHEMAS.values()) | {"torch_distributed.yaml"} == set(recorded)
    for name, source in recorded.items():
        assert (CRDS / name).is_file() and len(source["commit"]) == 40 and source["release"].startswith("v")
    assert recorded["trainjob.json"]["release"] == "v2.3.0" and recorded["pytorchjob.json"]["release"] == "v1.9.4"
