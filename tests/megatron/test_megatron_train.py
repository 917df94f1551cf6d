"""toolkit/train.py --backend megatron under torchrun, 2 CPU ranks over gloo, real Megatron-Core: TP=2, PP=2 (1F1B)
and DP=2 with the distributed optimizer each train the tiny recipe (the loss falls), write metrics.jsonl and verified
dist checkpoints (written in the background, each with its record); a resume reproduces the uninterrupted run, also at another TP/PP (dist_checkpointing reshards)."""

import json

import pytest
import torch
import yaml
from megatron_helpers import MOE_STEPS, RESAVE_AT, SAVE_AT, STEPS, TINY_MEGATRON, TINY_MOE

from helpers import (
    assert_profiled,
    assert_restarted_in_process,
    free_port,
    launch_watched,
    pid_recorder,
    wandb_history,
)
from toolkit.checkpoint.dcp import DistCheckpointReader
from toolkit.checkpoint.manifest import read_manifest, resolve_latest
from toolkit.checkpoint.safe_load import read_dcp_metadata
from toolkit.checkpoint.verify import verify
from toolkit.cli.main import main
from toolkit.runtime.incident import read_incidents
from toolkit.runtime.metrics import read_checkpoint_records, read_metrics

pytestmark = pytest.mark.launch
METRIC_KEYS = {"step", "loss", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s", "mfu", "data_wait_s",
               "data_sha"}
LAYOUTS = {"tp2": dict(tp=2, pp=1, dp=1, distributed_optimizer=False),
           "pp2": dict(tp=1, pp=2, dp=1, distributed_optimizer=False),
           "dp2": dict(tp=1, pp=1, dp=2, distributed_optimizer=True)}


def assert_checkpoint(run, step: int, **layout) -> dict:
    ckpt = run.out / f"checkpoint-{step}"
    report = verify(ckpt)
    assert report.ok and report.manifest, report.problems
    manifest = read_manifest(ckpt)
    assert manifest["format"] == "megatron-core-dist" and manifest["step"] == step
    assert {k: manifest["layout"][k] for k in layout} == layout
    return manifest


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_trains_and_saves_dist_checkpoints(layout_run, layout):
    run = layout_run(layout)
    records = read_metrics(run.out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), run.tail()
    for record in records:
        assert METRIC_KEYS <= set(record)
        assert record["loss"] > 0 and record["grad_norm"] > 0 and record["learning_rate"] >= 0
        # what the step cost; the recipe names an H100 but trains on CPU ranks: no catalogue peak, no allocator
        assert record["step_time_s"] > 0 and 0 <= record["data_wait_s"] < record["step_time_s"]
        assert record["tokens_per_s"] == pytest.approx(16 * 64 / record["step_time_s"])
        assert record["mfu"] is None and not [key for key in record if key.startswith("gpu_")]
    assert all(r["tokens_per_s"] > 0 for r in records[1:])
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 1.0, (first, last)  # the tiny corpus is learnable: the loss clearly falls
    assert resolve_latest(run.out) == run.out / f"checkpoint-{STEPS}"
    for step in (SAVE_AT, STEPS):
        assert_checkpoint(run, step, **LAYOUTS[layout])
    assert list((run.out / f"checkpoint-{STEPS}").glob("*.distcp")), "not a torch_dist checkpoint"
    assert_saves_recorded(run)
    assert run.rc == 0, run.tail()


def test_profiled_megatron_steps_name_the_tensor_parallel_wait_as_communication(layout_run):
    """TP=2: Megatron-Core's all-reduces in every layer's forward and backward wait on gloo's thread while the
    training thread calls nothing: the breakdown holds them as exposed communication."""
    breakdown = assert_profiled(layout_run("tp2").out)
    assert all(row["communication_exposed_s"] > 0 for row in breakdown["steps"]), breakdown["steps"]
    assert breakdown["predicted"]["communication_exposed_s"] > 0  # the estimator's TP all-reduces, beside them


def assert_saves_recorded(run) -> None:
    """Each checkpoint's metrics.jsonl record: written in the background (Megatron-Core's default), its size the
    manifest's, complete only after training went on (its record follows the next step's), never paused for longer
    than it took."""
    saves = read_checkpoint_records(run.out)
    assert [(r["step"], r["checkpoint"], r["async"]) for r in saves] == \
           [(s, f"checkpoint-{s}", True) for s in (SAVE_AT, STEPS)], run.tail()
    for record in saves:
        files = read_manifest(run.out / record["checkpoint"])["files"].values()
        assert record["bytes"] == sum(f["bytes"] for f in files) > 0
        assert 0 < record["blocking_s"] <= record["persist_s"]
    lines = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    order = [("checkpoint" if "kind" in r else "step", r["step"]) for r in lines]
    assert order.index(("checkpoint", SAVE_AT)) > order.index(("step", SAVE_AT + 1))


def test_wandb_gets_what_metrics_jsonl_has(layout_run):
    """The dp2 recipe reports to wandb (offline: no API key in tests): Megatron-Core's loop logs every record under
    train/, as the HF Trainer's callback names them, from rank 0 only."""
    run = layout_run("dp2")
    assert len(list((run.out / "wandb").glob("offline-run-*"))) == 1, run.tail()
    logged = {row["train/global_step"]: row for row in wandb_history(run.out)}
    records = read_metrics(run.out)
    assert sorted(logged) == [r["step"] for r in records]
    for record in records:
        for key in ("loss", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s", "data_wait_s"):
            assert logged[record["step"]][f"train/{key}"] == pytest.approx(record[key]), key


def test_every_layout_sees_the_same_global_batches(layout_run):
    """Step s trains on the same samples whatever the layout: the data order depends on the step only."""
    shas = {layout: [r["data_sha"] for r in read_metrics(layout_run(layout).out)] for layout in LAYOUTS}
    assert shas["tp2"] == shas["pp2"] == shas["dp2"]
    assert len(set(shas["tp2"])) == STEPS


def _resumed(torchrun, name, recipe, source, *flags, at: int = SAVE_AT):
    run = torchrun(name, "--recipe", str(recipe), *flags, "--max-steps", str(STEPS),
                   "--resume", str(source.out / f"checkpoint-{at}"))
    records = read_metrics(run.out)
    assert [r["step"] for r in records] == list(range(at + 1, STEPS + 1)), run.tail()
    return run, records


def test_resume_with_the_distributed_optimizer_reproduces_the_run_exactly(layout_run, dp2_resumed):
    """Model, optimizer (sharded Adam moments and step), scheduler and RNG come back from a background save
    (dp_reshardable): every resumed step equals the uninterrupted run's, bit for bit."""
    reference = read_metrics(layout_run("dp2").out)[SAVE_AT:]
    run = dp2_resumed
    records = read_metrics(run.out)
    assert [r["step"] for r in records] == list(range(SAVE_AT + 1, STEPS + 1)), run.tail()
    for got, want in zip(records, reference):
        assert {k: got[k] for k in ("step", "loss", "grad_norm", "learning_rate", "data_sha")} == \
               {k: want[k] for k in ("step", "loss", "grad_norm", "learning_rate", "data_sha")}
    assert_checkpoint(run, STEPS, tp=1, pp=1, dp=2)
    # the distributed optimizer's format follows the kind of save: a background one keeps its pause free of the
    # gather onto rank 0, a synchronous one stays loadable at any layout
    assert read_manifest(layout_run("dp2").out / f"checkpoint-{SAVE_AT}")["optimizer_sharding"] == "dp_reshardable"
    assert read_manifest(run.out / f"checkpoint-{RESAVE_AT}")["optimizer_sharding"] == "fully_reshardable"
    assert [r["async"] for r in read_checkpoint_records(run.out)] == [False, False]
    assert run.rc == 0, run.tail()


@pytest.mark.parametrize("source, target", [("dp2", "tp2"), ("tp2", "pp2")])
def test_resume_at_another_layout_continues_the_same_run(layout_run, torchrun, dp2_resumed, distopt_sync_recipe,
                                                         source, target):
    """A checkpoint saved at one TP/PP/DP layout loads at another (dist_checkpointing reshards model and optimizer
    state): the first step after the reload has the loss of the uninterrupted run, and the run stays on it. The
    distributed optimizer's state moves to TP=2 from a synchronous save (fully_reshardable); a background save's
    (dp_reshardable) is refused there (tests/unit/test_megatron_sharding.py)."""
    flags = {"tp2": ("--tp", "2"), "pp2": ("--pp", "2")}[target]
    if source == "dp2":
        at, origin, recipe = RESAVE_AT, dp2_resumed, distopt_sync_recipe
    else:
        at, origin, recipe = SAVE_AT, layout_run(source), TINY_MEGATRON
    reference = read_metrics(layout_run(source).out)[at:]
    run, records = _resumed(torchrun, f"{source}-to-{target}", recipe, origin, *flags, at=at)
    assert records[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-6)
    for got, want in zip(records, reference):
        assert got["data_sha"] == want["data_sha"] and got["learning_rate"] == pytest.approx(want["learning_rate"])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)
    assert_checkpoint(run, STEPS, **{k: v for k, v in LAYOUTS[target].items() if k != "distributed_optimizer"})
    assert run.rc == 0, run.tail()


# each MoE family's tiny model on 2 ranks (the experts' plan flags; conftest.moe_run): EP 2, and EP 2 folded over TP 2
# (the same 2 ranks are attention's TP group and the experts' EP group, ETP 1; MoE at TP > 1 needs sequence
# parallelism, which the local spec's torch norms get from toolkit.compat.megatron_seams). deepseek_v3 folded:
# multi-latent attention, a shared expert, the sigmoid router's expert bias and one MTP layer (MLATransformerConfig).
# gpt_oss is mapped for dmt convert only (dmt generate refuses its sinks: test_megatron_generate.py)
FOLDED = ("--tp", "2", "--ep", "2", "--etp", "1", "--sequence-parallel")
MOE_LAYOUTS = {"qwen3_moe": ("--ep", "2"), "deepseek_v3": FOLDED, "mixtral": FOLDED}


def _first_key(metadata, suffixes: tuple[str, ...]) -> str:
    """The first decoder tensor of a dist checkpoint ending in one of `suffixes` (stacked layers, decoder.layers.X,
    or one layer's own, decoder.layers.0.X, as the MLA block spec saves them)."""
    return sorted(k for k in metadata.state_dict_metadata if k.startswith("decoder.layers.") and k.endswith(suffixes))[0]


@pytest.mark.parametrize("family", sorted(MOE_LAYOUTS))
def test_moe_trains_with_its_experts_split_over_the_ep_ranks(moe_run, family, capsys):
    """Megatron-Core's own MoE layer at EP 2 on 2 gloo ranks, from the files `dmt generate` wrote: each rank holds
    only its half of the experts (global experts 0-1 on EP rank 0, 2-3 on EP rank 1, the alltoall dispatcher between
    them), whole at ETP 1 even where the attention is split over TP 2 (folded: the checkpoint holds each TP rank's
    half of the query projection), the loss falls, and every step's record has the tokens routed to each expert
    (the MTP layer's too), the measured imbalance and the router's load balancing (its loss, or DeepSeek-V3's expert
    bias moving); `dmt report` sets that imbalance beside the plan's --moe-imbalance."""
    from toolkit.cli.main import main
    from toolkit.report.runs import read_run
    from toolkit.spec.options import MOE_IMBALANCE_DEFAULT

    run = moe_run(family, *MOE_LAYOUTS[family])
    assert run.rc == 0, run.tail()
    config = TINY_MOE[family]
    experts = config.get("num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
    mtp = 1 if family == "deepseek_v3" else 0  # DeepseekV3Config's num_nextn_predict_layers default
    layout = json.loads((run.out / "moe_layout.json").read_text())
    assert (layout["num_experts"], layout["ep"], layout["etp"]) == (experts, 2, 1)
    tp = 2 if MOE_LAYOUTS[family] == FOLDED else 1
    assert [rank["tp_rank"] for rank in layout["ranks"]] == ([0, 1] if tp == 2 else [0, 0])
    fc1 = [2 * config.get("moe_intermediate_size", config["intermediate_size"]), config["hidden_size"]]
    moe_layers = {f"decoder.layers.{i}.mlp" for i in range(config["num_hidden_layers"])}
    for ep_rank, rank in enumerate(layout["ranks"]):
        assert rank["ep_rank"] == ep_rank
        assert set(rank["layers"]) == moe_layers | {f"mtp.layers.{i}.transformer_layer.mlp" for i in range(mtp)}
        for layer in rank["layers"].values():
            assert layer["dispatcher"] == "MoEAlltoAllTokenDispatcher"
            assert layer["experts"] == [ep_rank * 2, ep_rank * 2 + 1]  # this rank's half, no more
            params = layer["expert_parameters"]
            assert sorted(params) == [f"local_experts.{e}.linear_fc{n}.weight" for e in (0, 1) for n in (1, 2)]
            assert params["local_experts.0.linear_fc1.weight"] == fc1
    # what each rank wrote to the checkpoint: expert e's weights in EP rank e // 2's files (__<rank>_<n>.distcp)
    metadata = read_dcp_metadata(run.out / f"checkpoint-{MOE_STEPS}")
    fc2 = _first_key(metadata, ("mlp.experts.experts.linear_fc2.weight",))
    axis = len(metadata.state_dict_metadata[fc2].size) - 3  # the experts' axis, after the layers' where stacked
    writers = {(tuple(index.offset)[axis], info.relative_path.split("_")[2])
               for index, info in metadata.storage_data.items() if index.fqn == fc2}
    assert writers == {(expert, str(expert // 2)) for expert in range(experts)}
    query = metadata.state_dict_metadata[_first_key(metadata, ("self_attention.linear_qkv.weight",
                                                               "self_attention.linear_q_proj.weight"))]
    rows = len(query.size) - 2
    assert {tuple(chunk.sizes)[rows] for chunk in query.chunks} == {query.size[rows] // tp}  # split over TP
    records = read_metrics(run.out)
    assert [r["step"] for r in records] == list(range(1, MOE_STEPS + 1)), run.tail()
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    routed = 2 * 16 * 64  # top 2 of every token of the global batch, in each MoE layer
    for record in records:
        tokens = torch.tensor(record["moe_tokens_per_expert"])
        assert tokens.shape == (config["num_hidden_layers"] + mtp, experts) and (tokens.sum(dim=1) == routed).all()
        per_ep_rank = tokens.view(-1, 2, experts // 2).sum(dim=2).double()
        assert record["moe_imbalance"] == pytest.approx((per_ep_rank.max(1).values / per_ep_rank.mean(1)).max())
        if family == "deepseek_v3":  # the complementary sequence-wise loss, and the bias moved by the load
            assert record["moe_seq_load_balancing_loss"] > 0
            assert torch.tensor(record["moe_expert_bias"]).shape == tokens.shape
        else:
            assert record["moe_load_balancing_loss"] >= 1.0 - 1e-6  # Switch's loss is 1 when balanced, more when not
    if family == "deepseek_v3":  # after step 1 each expert's bias is one update from 0: up if under-loaded
        from megatron.core.transformer.transformer_config import TransformerConfig

        tokens = torch.tensor(records[0]["moe_tokens_per_expert"], dtype=torch.float64)
        rate = TransformerConfig.moe_router_bias_update_rate
        expected = rate * torch.sign(tokens.mean(dim=1, keepdim=True) - tokens)
        got = torch.tensor(records[0]["moe_expert_bias"], dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=1e-6, atol=0), (got, tokens)
        # the TP 2 x EP 2 checkpoint, MTP layer and all, converts to a model transformers loads (mtp.* not read)
        from transformers import AutoModelForCausalLM

        from toolkit.backends.megatron.convert import megatron_to_hf

        megatron_to_hf(run.out / f"checkpoint-{MOE_STEPS}", run.out / "hf")
        model = AutoModelForCausalLM.from_pretrained(run.out / "hf")
        assert model.config.model_type == "deepseek_v3" and model.config.n_routed_experts == experts
    report = read_run(run.out, warmup=0)
    seen = [r["moe_imbalance"] for r in records]
    planned = MOE_IMBALANCE_DEFAULT  # the recipe states none
    assert report.moe["imbalance_max"] == max(seen) and report.moe["planned_imbalance"] == planned
    assert report.moe["above_plan"] == (max(seen) > planned)
    capsys.readouterr()
    assert main(["report", str(run.out), "--warmup", "0"]) == 0
    assert f"max {max(seen):.3g} over {MOE_STEPS} steps; the plan assumed {planned:.3g}" in capsys.readouterr().out


def test_an_ep_sharded_checkpoint_converts_in_one_process_one_expert_at_a_time(moe_run, tmp_path):
    """The qwen3_moe run's checkpoint, written by 2 EP ranks (each its own experts' file), read back in this one
    process: `dmt ckpt inspect` says what its experts are, megatron-to-hf holds at most one expert tensor's bytes
    beyond the largest non-expert one and gives a model transformers loads; a truncated expert file is found by
    `dmt ckpt verify` and is one line naming the file and the expert."""
    import shutil

    from transformers import AutoModelForCausalLM

    from toolkit.backends.megatron.convert import megatron_to_hf
    from toolkit.checkpoint.dcp import LiveBytes
    from toolkit.checkpoint.verify import inspect
    from toolkit.errors import UserInputError

    run = moe_run("qwen3_moe", *MOE_LAYOUTS["qwen3_moe"])
    ckpt = run.out / f"checkpoint-{MOE_STEPS}"
    config = TINY_MOE["qwen3_moe"]
    experts = inspect(ckpt)["experts"]
    fc1, fc2 = 2 * config["moe_intermediate_size"] * 64, 64 * config["moe_intermediate_size"]
    assert {k: experts[k] for k in ("count", "moe_layers", "ep", "etp", "bytes_per_expert")} == \
           {"count": 4, "moe_layers": 2, "ep": 2, "etp": 1, "bytes_per_expert": (fc1 + fc2) * 4}
    live = LiveBytes()
    megatron_to_hf(ckpt, tmp_path / "hf", live=live)
    largest = 512 * 64 * 4  # the embedding and the output layer (vocabulary 512, fp32)
    assert 0 < live.peak <= 2 * largest and live.live == 0, live.peak
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "__1_0.distcp").write_bytes((broken / "__1_0.distcp").read_bytes()[:1000])  # EP rank 1's experts
    report = verify(broken)
    assert not report.ok and any("__1_0.distcp" in p["file"] for p in report.problems)
    with pytest.raises(UserInputError) as refused:
        megatron_to_hf(broken, tmp_path / "out")
    message = str(refused.value)
    assert "__1_0.distcp" in message and "truncated" in message and "expert 2 of layer 0" in message
    assert "\n" not in message and not (tmp_path / "out").exists()


def _model_tensors(ckpt) -> dict:
    """The model's tensors of a dist checkpoint, read whole (the optimizer's are stored per its sharding format)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = DistCheckpointReader(ckpt)
    return {key: reader.read(key, [0] * len(meta.size), list(meta.size)) for key, meta in reader.tensors.items()
            if isinstance(meta, TensorStorageMetadata) and not key.startswith(("optimizer.", "rng_state"))
            and "_extra_state" not in key}


def test_in_process_restart_replaces_a_killed_rank_and_ends_as_the_uninterrupted_run(layout_run, megatron_recipe,
                                                                                     tmp_path):
    """training.restart: in_process (NVRx's in-process Wrapper) through the generated launch.sh's `inprocess`
    launcher: 2 ranks and a hot spare, with node-local checkpoints (checkpoint.local, NVRx's LocalCheckpointManager)
    at the odd steps between the persistent ones. Rank 1 is SIGKILLed in step 6, after checkpoint-4 and the local
    checkpoint of step 5: rank 0's process is not relaunched (same pid before and after), the spare becomes rank 1,
    training continues from the local checkpoint of step 5 (newer than `latest`, checkpoint-4) and every step is
    logged once, each equal to the uninterrupted dp2 run's to the bit, and so are the final weights."""
    import torch

    local_dir = tmp_path / "node-local"
    recipe = megatron_recipe("tiny-megatron-inprocess", plan={"distributed_optimizer": True},
                             training={"max_steps": STEPS, "save_steps": 2, "async_save": False,
                                       "restart": "in_process", "spare_ranks": 1, "hang_timeout_s": 120},
                             checkpoint={"local": {"dir": str(local_dir), "every": 1}})
    generated, out, log = tmp_path / "gen", tmp_path / "run", tmp_path / "inprocess.log"
    assert main(["generate", str(recipe), "--out", str(generated)]) == 0
    pids: dict = {}
    rc = launch_watched(["bash", str(generated / "launch.sh"), "inprocess"], log, pid_recorder(pids),
                        {"OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
                         "DMT_FAULT": f"kill@rank=1,step={SAVE_AT + 2},phase=train"})
    text = log.read_text()
    assert rc == 0 and "fault injection: kill on rank 1" in text, text[-3000:]
    # not relaunched: rank 0 is the process launch.sh started; the spare (launched as rank 2) is rank 1 now
    assert_restarted_in_process(out, text, pids, f"checkpoint-{SAVE_AT}", SAVE_AT + 2)
    # the local checkpoint of step 5, newer than the persistent checkpoint-4, is what the restart read
    [local] = [event for event in read_incidents(out) if event["event"] == "local_resume"]
    assert local["step"] == SAVE_AT + 1 and local["persistent"] == f"checkpoint-{SAVE_AT}", local
    assert local["dir"] == str(local_dir), local
    reference = read_metrics(layout_run("dp2").out)
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    keys = ("step", "loss", "grad_norm", "learning_rate", "data_sha")
    assert [{k: r[k] for k in keys} for r in records] == [{k: r[k] for k in keys} for r in reference]
    got, want = _model_tensors(out / f"checkpoint-{STEPS}"), _model_tensors(layout_run("dp2").out / f"checkpoint-{STEPS}")
    assert got.keys() == want.keys() and got and all(torch.equal(got[k], want[k]) for k in got)
    assert verify(resolve_latest(out)).ok
    # NVRx kept each rank's newest local checkpoint (step 7: 8 is persistent), written under the run's name
    name = yaml.safe_load(recipe.read_text())["name"]
    assert sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*.pt")) == [
        f"{name}/{rank}/iter_{STEPS - 1:07d}_{rank}_local.pt" for rank in (0, 1)]
    report = verify(local_dir)
    assert report.ok and report.format == "nvrx-local" and report.files_checked == 2, report.problems
