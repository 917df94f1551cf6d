"""Long-context plans: Ulysses (sp), context parallel on FSDP2 (cp), sequence tiles and activation offload, their
rules, memory terms, the longest sequence a plan fits, and TiledMLP's saved bytes against DeepSpeed's own module."""

import pytest

from toolkit.errors import UserInputError
from toolkit.estimate.memory import estimate_memory, exceeded
from toolkit.planner.max_seq_len import longest_sequence
from toolkit.spec.cluster import get_gpu, with_host_memory
from toolkit.spec.model import load_model_spec
from toolkit.spec.plan import resolve_plan

LLAMA_8B = load_model_spec("llama-3.1-8b")  # 32 heads, 8 kv heads
H100 = get_gpu("h100-80gb")


@pytest.mark.parametrize("gpus, options, key, says", [
    (12, dict(sp=12), "--sp", "must divide the attention heads (32)"),
    (16, dict(sp=16), None, None),  # 16 > 8 kv heads and a multiple of them: kv heads replicated
    (8, dict(sp=2, seq_len=4097), "--seq-len", "divisible by sp = 2"),
    (8, dict(sp=2, attention="eager"), "--attention", "eager"),
    (8, dict(sp=2, backend="fsdp"), "--sp", "runs with --backend deepspeed"),
    (8, dict(sp=2, backend="megatron"), "--sp", "Megatron-Core splits the sequence with --cp"),
    (8, dict(cp=2), "--cp", "with deepspeed use --sp (Ulysses)"),
    (8, dict(cp=4, backend="fsdp", seq_len=4100), "--seq-len", "2 x cp = 8"),
    (8, dict(cp=2, backend="fsdp", attention="eager"), "--attention", "sdpa only"),
    (8, dict(offload_activations="cpu"), "--offload-activations", "needs --recompute full"),
    (8, dict(offload_activations="cpu", recompute="full", backend="megatron"), "--offload-activations", "cpu_offloading"),
    (8, dict(tiled_mlp=True, backend="megatron"), "--tiled-mlp", None),
])
def test_rules_follow_the_libraries_in_one_line(gpus, options, key, says):
    if key is None:
        assert resolve_plan(LLAMA_8B, gpus, **options).dp == gpus // options["sp"]
        return
    with pytest.raises(UserInputError) as caught:
        resolve_plan(LLAMA_8B, gpus, **options)
    assert caught.value.key == key and (says is None or says in caught.value.message), caught.value


def test_the_sequence_split_shares_the_batch_and_shards_the_states_over_every_rank():
    plan = resolve_plan(LLAMA_8B, 8, sp=4, zero=3)
    assert (plan.dp, plan.data_ranks) == (2, 8)
    fsdp = resolve_plan(LLAMA_8B, 8, backend="fsdp", cp=4)
    assert (fsdp.dp, fsdp.dp_shard, fsdp.data_ranks) == (2, 2, 8)
    one = estimate_memory(LLAMA_8B, resolve_plan(LLAMA_8B, 8, backend="fsdp"))
    assert estimate_memory(LLAMA_8B, fsdp).weights == pytest.approx(one.weights, rel=1e-6)  # dp_shard x cp = 8


def test_each_option_removes_its_own_term():
    base = dict(zero=3, seq_len=16384, recompute="full")
    plain = estimate_memory(LLAMA_8B, resolve_plan(LLAMA_8B, 8, **base))
    split = estimate_memory(LLAMA_8B, resolve_plan(LLAMA_8B, 8, sp=8, **base))
    assert split.activations == pytest.approx(plain.activations / 8, rel=0.05)
    assert "ulysses_all_to_all" in split.overhead_detail and "ulysses_all_to_all" not in plain.overhead_detail
    tiled = estimate_memory(LLAMA_8B, resolve_plan(LLAMA_8B, 8, tiled_loss=True, tiled_mlp=True, **base))
    # untiled, the loss's three fp32 logits set the peak; tiled, one tile of them does not
    assert plain.overhead_detail["head_backward"] > tiled.overhead_detail.get("head_backward", 0)
    assert tiled.activations < plain.activations and tiled.total < plain.total
    offloaded = estimate_memory(LLAMA_8B, resolve_plan(LLAMA_8B, 8, offload_activations="cpu", **base))
    moved = plain.activations - offloaded.activations
    assert offloaded.host_bytes == moved > 0  # the checkpoints left the GPU for the host, byte for byte
    node = with_host_memory(H100, offloaded.host_bytes * 8 / 2**30 * 0.99)
    assert exceeded(offloaded, node, 8)[0] == "host" and exceeded(offloaded, H100, 8) is None


def test_the_longest_sequence_fits_and_the_next_one_does_not():
    options = dict(zero=3, sp=8, recompute="full", tiled_mlp=True, tiled_loss=True)
    found = longest_sequence(LLAMA_8B, 8, H100, **options)
    assert found.max_seq_len % 1024 == 0 and found.max_seq_len == found.plan.seq_len
    assert estimate_memory(LLAMA_8B, found.plan).total <= H100.memory_bytes
    after = estimate_memory(LLAMA_8B, resolve_plan(LLAMA_8B, 8, seq_len=found.limit["seq_len"], **options))
    assert after.total > H100.memory_bytes and found.limit["seq_len"] == found.max_seq_len + 1024
    assert set(found.as_json()) == {"max_seq_len", "limit"} and found.limit["component"] == "activations"
    assert longest_sequence(LLAMA_8B, 8, H100, zero=3).max_seq_len < found.max_seq_len


def test_tiled_mlp_keeps_what_deepspeeds_tiledmlp_saves():
    torch = pytest.importorskip("torch")
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from toolkit.estimate.long_context import mlp_tiles
    from toolkit.estimate.measure import saved_activation_bytes
    from toolkit.estimate.memory import activation_setup
    from toolkit.spec.model import spec_from_hf_dict

    config = AutoConfig.for_model("llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=512, vocab_size=1000, pad_token_id=0)
    spec = spec_from_hf_dict(config.to_dict(), "llama", filled=True)
    seq = 512
    shards = []

    def tiled_forward(self, x):  # the patch DeepSpeed's TiledMLP docstring gives for LlamaMLP
        shards.append(max(1, -(-x.shape[1] // x.shape[2])))
        return TiledMLP.apply(lambda mlp, t: mlp.down_proj(mlp.act_fn(mlp.gate_proj(t)) * mlp.up_proj(t)), self, x,
                              shards[-1], [])

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).train()
    ids = torch.randint(0, 1000, (1, seq))
    plain = saved_activation_bytes(model, input_ids=ids, labels=ids)
    original = modeling_llama.LlamaMLP.forward
    modeling_llama.LlamaMLP.forward = tiled_forward
    try:
        tiled = saved_activation_bytes(model, input_ids=ids, labels=ids)
    finally:
        modeling_llama.LlamaMLP.forward = original
    estimated = {t: estimate_memory(spec, resolve_plan(spec, 1, zero=0, seq_len=seq, tiled_mlp=t)).activations
                 for t in (False, True)}
    assert estimated[True] == pytest.approx(tiled, rel=0.10), (estimated, tiled)
    assert estimated[False] - estimated[True] == pytest.approx(plain - tiled, rel=0.10)
    setup = activation_setup(spec, resolve_plan(spec, 1, zero=0, seq_len=seq, tiled_mlp=True))
    assert shards == [mlp_tiles(spec, setup)] * 2


@pytest.mark.parametrize("options, over", [
    (dict(backend="fsdp", cp=2, seq_len=32768), "dp_shard x cp = 4 x 2 = 8"),
    (dict(backend="deepspeed", sp=2, zero=3, seq_len=32768), "dp x sp = 8"),
])
def test_explain_names_the_ranks_the_states_are_sharded_over_with_the_sequence_split(options, over):
    """--explain says what the memory model divides by: with cp (FSDP2) or sp (ZeRO) the states shard over 8 ranks,
    not over the 4 of dp_shard or dp, and the saving against one unsplit replica is 1 - 1/8."""
    from toolkit.estimate.comm import Network
    from toolkit.estimate.explain import explain_estimate
    from toolkit.planner.predict import predicted_record

    plan = resolve_plan(LLAMA_8B, 8, **options)
    entries = {e["component"]: e for e in explain_estimate(LLAMA_8B, predicted_record(
        LLAMA_8B, plan, H100, Network(H100.intra_node_bw_gbps, H100.inter_node_bw_gbps, 8), None))}
    assert over in entries["gradients"]["difference"] + entries["optimizer"]["rule"]
    assert entries["optimizer"]["saving_vs_unsharded"] == pytest.approx(1 - 1 / 8)


def test_tiled_loss_keeps_what_training_tiled_loss_saves():
    """The logits+loss term with and without tiles against the bytes the model saves for backward on CPU, with the
    loss tiled by training's own function (toolkit/backends/long_context.tile_loss over DeepSpeed's
    sequence_tiled_compute): without tiles the fp32 [s, vocab] logits stay, with them only the head's input."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.backends.long_context import tile_loss
    from toolkit.estimate.measure import saved_activation_bytes
    from toolkit.spec.model import spec_from_hf_dict

    config = AutoConfig.for_model("llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=512, vocab_size=8000, pad_token_id=0)
    spec = spec_from_hf_dict(config.to_dict(), "llama", filled=True)
    seq = 512
    ids = torch.randint(0, 8000, (1, seq))
    measured = {}
    for tiled in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).train()
        if tiled:
            tile_loss(model, tile_bytes=4 * 8000 * 64)  # tiles of 64 tokens' fp32 logits
        measured[tiled] = saved_activation_bytes(model, input_ids=ids, labels=ids)
    estimated = {t: estimate_memory(spec, resolve_plan(spec, 1, zero=0, seq_len=seq, tiled_loss=t)).activations
                 for t in (False, True)}
    assert measured[False] - measured[True] > seq * 8000 * 4  # the fp32 logits really went
    assert estimated[False] - estimated[True] == pytest.approx(measured[False] - measured[True], rel=0.10)
    assert estimated[True] == pytest.approx(measured[True], rel=0.10), (estimated, measured)


def test_tiled_mlps_train_as_the_untiled_ones_and_refuse_a_forward_they_cannot_tile():
    """Training's tile_mlps (through toolkit.compat.deepspeed_seams.tile_forward, DeepSpeed's TiledMLP): the same loss
    and gradients as the untiled model, in 4 tiles of a 512-token sequence at hidden size 128; an MLP whose forward
    takes more than x is refused naming the plan key."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.backends.long_context import tile_mlps

    config = AutoConfig.for_model("llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=512, vocab_size=1000, pad_token_id=0)
    ids = torch.randint(0, 1000, (1, 512))
    runs = []
    for tiled in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
        if tiled:
            assert tile_mlps(model) == 2
            assert all("forward" in vars(layer.mlp) for layer in model.get_decoder().layers)  # the instances' own
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (tiled, tiled_grads) = runs
    torch.testing.assert_close(tiled, plain)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, msg=name)

    class TwoInputs(torch.nn.Module):
        def forward(self, x, mask):
            return x

    model.get_decoder().layers[0].mlp = TwoInputs()
    with pytest.raises(UserInputError, match="plan.tiled_mlp"):
        tile_mlps(model)
