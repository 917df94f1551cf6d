"""The catalogue's 2025-2026 parts and the cluster's shape: a scale-up (NVLink) domain apart from the node, and the
scale-out tiers. An NVL72 plan (gb200, 4 GPUs per node, 72 on one NVLink domain) keeps tensor and expert parallelism
inside the rack, not the node; its Slurm script asks for one rack's nodes and NCCL's multi-node NVLink, its
Kubernetes manifests carry NVIDIA's ComputeDomain, and `dmt validate` accepts them."""

import json
import shutil

import pytest
import yaml

from helpers import ROOT
from toolkit.cli.main import main
from toolkit.estimate.comm import ACHIEVABLE_BUS_FRACTION, INTRA_NODE_LATENCY_S, SCALE_OUT, Network
from toolkit.estimate.timing import step_time
from toolkit.generate.slurm import nvlink_segment
from toolkit.planner.search import enumerate_layouts, search
from toolkit.spec.cluster import CATALOGUE, get_gpu, topology_defaults
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

NVL72_RECIPE = ROOT / "recipes" / "qwen3-30b-a3b-megatron-gb200-nvl72.yaml"
GB200 = get_gpu("gb200")
QWEN_MOE = load_model_spec("qwen3-30b-a3b")
LLAMA_70B = load_model_spec("llama-3.1-70b")
NEW = ("b300", "gb200", "gb300", "mi355x")


def _network(gpu, **options) -> Network:
    shape = topology_defaults(gpu, options)
    return Network.from_catalogue(gpu, shape["gpus_per_node"], shape.get("nvlink_domain"))


def test_the_new_parts_carry_sources_and_dense_peaks_per_precision():
    raw = yaml.safe_load(CATALOGUE.read_text())["gpus"]
    for name in NEW:
        gpu = get_gpu(name)
        assert raw[name]["source"] and all("http" in s for s in raw[name]["source"])
        peaks = gpu.peak_tflops
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=1e-3)  # dense FP8 is twice dense BF16
        assert peaks["mxfp8"] == peaks["fp8"]
        assert 178 * 2**30 < gpu.memory_bytes < 290 * 2**30
    for name in ("b300", "gb200", "gb300"):  # Blackwell: NVFP4; CDNA 4: the OCP MX formats only
        assert get_gpu(name).peak_tflops["nvfp4"] >= 2 * get_gpu(name).peak_tflops["fp8"]
    assert "nvfp4" not in get_gpu("mi355x").peak_tflops and "mxfp4" in get_gpu("mi355x").peak_tflops
    # GB200's MFU denominator is NVIDIA's 2,500 TFLOP/s, not the 2,250 torchtitan gives any name holding "B200"
    assert GB200.peak_tflops["bf16"] == 2500 and get_gpu("b200").peak_tflops["bf16"] == 2250
    for name in ("gb200", "gb300"):
        assert (get_gpu(name).gpus_per_node_default, get_gpu(name).nvlink_domain) == (4, 72)
    assert get_gpu("b300").nvlink_domain is None and get_gpu("h100-80gb").nvlink_domain is None


def test_the_catalogue_shapes_the_cluster_unless_the_plan_says():
    assert topology_defaults(GB200, {}) == {"gpus_per_node": 4, "nvlink_domain": 72}
    assert topology_defaults(GB200, {"gpus_per_node": 2}) == {"gpus_per_node": 2, "nvlink_domain": 36}  # 18 trays
    assert topology_defaults(GB200, {"nvlink_domain": 36})["nvlink_domain"] == 36  # an NVL36 half-rack
    assert topology_defaults(get_gpu("h100-80gb"), {}) == {"gpus_per_node": 8}  # the node is the domain
    assert topology_defaults(get_gpu("cpu"), {}) == {}  # the host keeps the plan option's default


def test_a_group_crossing_nodes_inside_the_rack_runs_at_nvlink_rates():
    rack, nodes = _network(GB200), _network(GB200, nvlink_domain=4)
    nvlink = GB200.intra_node_bw_gbps * 1e9 * ACHIEVABLE_BUS_FRACTION
    # TP 8 spans two 4-GPU nodes: on the rack's NVLink, not through the NICs
    assert rack.link(8, 1).bus_bw == nvlink and rack.link(8, 1).latency_s == INTRA_NODE_LATENCY_S
    assert nodes.link(8, 1).bus_bw == 4 * GB200.inter_node_bw_gbps * 1e9 * SCALE_OUT["infiniband"].efficiency
    # EP 16 x TP 2: 32 GPUs, 8 nodes of the rack; past 72 GPUs a group leaves it
    assert not rack.crosses_domain(16, 2) and nodes.crosses_domain(16, 2) and rack.crosses_domain(64, 2)
    assert rack.all_to_all_time(64e6, 16, 2) < nodes.all_to_all_time(64e6, 16, 2) / 3


def test_an_nvl72_plan_keeps_tensor_and_expert_parallelism_inside_the_rack(capsys):
    # the planner tries tensor parallelism up to the NVLink domain: 8 (the kv heads) on 4-GPU nodes of a rack
    fixed = {"seq_len": 4096, "global_batch": 256}
    tps = {layout["tp"] for layout in enumerate_layouts(LLAMA_70B, 64, 72, "megatron", fixed)}
    assert max(tps) == 8 and max(t for layout in enumerate_layouts(LLAMA_70B, 64, 4, "megatron", fixed)
                                 for t in [layout["tp"]]) == 4
    found = search(LLAMA_70B, 64, GB200, _network(GB200), ("megatron",), tp=8, pp=4, seq_len=4096,
                   global_batch=256, micro_batch=1)
    assert found.ranked and all(c.plan.tp == 8 and c.plan.nvlink_domain == 72 for c in found.ranked)
    # the same TP 8 and EP 16 x TP 2 cost NVLink time on the rack, network time when the domain is the node
    for model, options in ((LLAMA_70B, dict(tp=8, pp=4)), (QWEN_MOE, dict(tp=2, ep=16))):
        plans = {domain: resolve_plan(model, 64, backend="megatron", gpus_per_node=4, nvlink_domain=domain,
                                      sequence_parallel=True, distributed_optimizer=True, global_batch=256,
                                      seq_len=4096, **options) for domain in (72, 4)}
        times = {domain: step_time(model, plan, GB200, _network(GB200)) for domain, plan in plans.items()}
        key = "ep_comm_s" if "ep" in options else "tp_comm_s"
        assert getattr(times[72], key) * 3 < getattr(times[4], key), key
    # `dmt estimate --gpu gb200` takes the rack from the catalogue
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--gpus", "64", "--gpu", "gb200", "--backend", "megatron",
                 "--tp", "2", "--ep", "16", "--sequence-parallel", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (plan["gpus_per_node"], plan["nvlink_domain"], plan["network"]) == (4, 72, "infiniband")


def test_scale_out_tiers_set_bandwidth_efficiency_and_latency_and_a_measurement_wins():
    plan = {net: resolve_plan(LLAMA_70B, 64, backend="megatron", tp=8, network=net) for net in ("infiniband", "roce", "ethernet")}
    network = _network(get_gpu("h100-80gb"))
    links = {net: network.for_plan(p).link(8, 8) for net, p in plan.items()}  # 8 nodes, one rank each
    assert links["infiniband"].bus_bw == 50e9 * SCALE_OUT["infiniband"].efficiency
    assert links["roce"].bus_bw == 50e9 * SCALE_OUT["roce"].efficiency
    assert links["ethernet"].bus_bw == SCALE_OUT["ethernet"].bandwidth_gbps * 1e9 * SCALE_OUT["ethernet"].efficiency
    assert links["ethernet"].latency_s > links["roce"].latency_s == links["infiniband"].latency_s
    measured = network.with_measured(inter=40.0).for_plan(plan["ethernet"])  # dmt health's busbw, as it is
    assert measured.link(8, 8).bus_bw == 40e9


@pytest.mark.parametrize("argv, named", [
    (["--gpu", "gb200", "--nvlink-domain", "6"], "--nvlink-domain"),
    (["--gpu", "h100-80gb", "--gpus-per-node", "8", "--nvlink-domain", "4"], "--nvlink-domain"),
    (["--nvlink-domain", "0"], "--nvlink-domain"),
    (["--network", "wifi"], "--network"),
])
def test_a_bad_domain_or_network_is_one_line_and_exit_2(capsys, argv, named):
    assert main(["estimate", "--model", "llama-3.1-8b", "--gpus", "8", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


@pytest.mark.parametrize("key, value", [("nvlink_domain", 6), ("network", "wifi")])
def test_a_bad_cluster_key_in_a_recipe_is_named_by_its_key(tmp_path, capsys, key, value):
    recipe = yaml.safe_load(NVL72_RECIPE.read_text())
    recipe["cluster"][key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["generate", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cluster.{key}" in err, err


def test_slurm_segment_is_one_racks_nodes():
    plan = resolve_plan(QWEN_MOE, 64, backend="megatron", gpus_per_node=4, nvlink_domain=72, tp=2, ep=16,
                        sequence_parallel=True)
    assert nvlink_segment(plan, 16, 4) == 16  # the whole job in one rack
    bigger = resolve_plan(QWEN_MOE, 144, backend="megatron", gpus_per_node=4, nvlink_domain=72, tp=2, ep=8,
                          sequence_parallel=True)
    assert nvlink_segment(bigger, 36, 4) == 18  # two racks of 18 nodes
    assert nvlink_segment(resolve_plan(QWEN_MOE, 80, gpus_per_node=4, nvlink_domain=72), 20, 4) == 10
    assert nvlink_segment(resolve_plan(QWEN_MOE, 64, gpus_per_node=8), 8, 8) is None  # HGX: the node is the domain


def test_the_nvl72_recipes_files_keep_the_job_in_a_rack_and_validate(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(NVL72_RECIPE, tmp_path / "recipe.yaml")
    assert main(["generate", "recipe.yaml", "--out", "gen"]) == 0, capsys.readouterr().err
    sbatch = (tmp_path / "gen" / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=16\n" in sbatch and "#SBATCH --gpus-per-node=4\n" in sbatch
    assert "#SBATCH --segment=16\n" in sbatch
    for script in (sbatch, (tmp_path / "gen" / "launch.sh").read_text()):
        assert 'export NCCL_MNNVL_ENABLE="${NCCL_MNNVL_ENABLE:-1}"' in script
        assert 'export NCCL_CUMEM_ENABLE="${NCCL_CUMEM_ENABLE:-1}"' in script
    assert json.loads((tmp_path / "gen" / "plan.json").read_text())["plan"]["nvlink_domain"] == 72
    for kind in ("trainjob", "jobset", "pytorchjob"):
        out = tmp_path / f"{kind}.yaml"
        assert main(["k8s", "render", "recipe.yaml", "--kind", kind, "--image", "ghcr.io/acme/dmt:1",
                     "--out", str(out)]) == 0, capsys.readouterr().err
        documents = list(yaml.safe_load_all(out.read_text()))
        domain = documents[0]
        assert (domain["apiVersion"], domain["kind"], domain["spec"]["numNodes"]) == (
            "resource.nvidia.com/v1beta1", "ComputeDomain", 16)
        template = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
        assert template in out.read_text().split("---", 1)[1]  # the job's pods claim it
        capsys.readouterr()
        assert main(["validate", str(out)]) == 0, capsys.readouterr()
        assert "ComputeDomain of NVIDIA/k8s-dra-driver-gpu v25.12.0" in capsys.readouterr().out
    # a manifest without the claims, or without the ComputeDomain, is refused, each problem named
    documents = list(yaml.safe_load_all((tmp_path / "jobset.yaml").read_text()))
    pod = documents[1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    del pod["resourceClaims"]
    (tmp_path / "unclaimed.yaml").write_text(yaml.safe_dump_all(documents))
    assert main(["validate", str(tmp_path / "unclaimed.yaml")]) == 2
    assert "resourceClaims: claims no channel of ComputeDomain" in capsys.readouterr().err
    (tmp_path / "no-domain.yaml").write_text(yaml.safe_dump_all(documents[1:]))
    assert main(["validate", str(tmp_path / "no-domain.yaml")]) == 2
    assert "spans nodes of 4: add the DRA driver's ComputeDomain" in capsys.readouterr().err


def test_an_hgx_plan_gets_no_segment_no_mnnvl_and_no_compute_domain(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "recipes" / "mixtral-8x7b-megatron.yaml", tmp_path / "recipe.yaml")
    assert main(["generate", "recipe.yaml", "--out", "gen"]) == 0, capsys.readouterr().err
    sbatch = (tmp_path / "gen" / "slurm.sbatch").read_text()
    assert "--segment" not in sbatch and "NCCL_MNNVL_ENABLE" not in sbatch
    assert main(["k8s", "render", "recipe.yaml", "--kind", "jobset", "--image", "ghcr.io/acme/dmt:1"]) == 0
    assert "ComputeDomain" not in capsys.readouterr().out
