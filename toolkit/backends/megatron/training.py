"""Train with Megatron-Core from a recipe: megatron.yaml built and validated in-process, the tokenised data the HF
Trainer backends read too, Megatron-Core's pipeline schedule, metrics.jsonl, and dist checkpoints with manifests.

Launched as `torchrun --nproc_per_node N toolkit/train.py --recipe R --backend megatron` (train.py dispatches here).
Without a GPU every Megatron-Core call runs inside `toolkit.compat.megatron_cpu.cuda_on_cpu()`; with one, that module is never imported.
"""

from __future__ import annotations

import logging
from pathlib import Path

from toolkit.backends.background_saves import save_wait_s
from toolkit.backends.data import build_tokenizer, load_texts, packed_datasets
from toolkit.backends.loop import (
    BatchFingerprints,
    StepGuard,
    check_world,
    global_batch_fingerprint,
    save_and_exit_requested,
    write_step_record,
)
from toolkit.backends.megatron.build import build, destroy, device_context, init_distributed, unwrapped
from toolkit.backends.megatron.checkpoint import load_checkpoint, save_checkpoint
from toolkit.backends.megatron.local import LocalCheckpoints
from toolkit.backends.megatron.moe import RoutingMetrics, write_expert_layout
from toolkit.backends.megatron.saves import CheckpointSaves
from toolkit.backends.resume import guard_window, resume_checkpoint, run_identity, trim_metrics
from toolkit.checkpoint.manifest import read_manifest
from toolkit.compat.megatron_seams import chained_step
from toolkit.data.blend import RankSteps, build_datasets, stack_samples
from toolkit.data.tokenizer import hf_tokenizer
from toolkit.errors import UserInputError
from toolkit.estimate.measure import peak_live_bytes
from toolkit.generate.megatron import megatron_config
from toolkit.runtime import faults, inprocess
from toolkit.runtime.guard import LossGuard, read_grad_norm
from toolkit.runtime.incident import append_incident
from toolkit.runtime.metrics import (
    MetricsWriter,
    Throughput,
    WandbRun,
    configure_wandb,
    gpu_memory_of_ranks,
)
from toolkit.runtime.profile import CHECKPOINT, DATA, OPTIMIZER, StepProfiler
from toolkit.runtime.supervision import TrainingWatchdog
from toolkit.spec.model import ModelSpec
from toolkit.spec.plan import Plan
from toolkit.spec.recipe import Recipe, data_workers, recipe_hf_config
from toolkit.validate.megatron import validate_megatron_config

log = logging.getLogger(__name__)


def megatron_yaml_for(recipe: Recipe, model: ModelSpec, plan: Plan) -> dict:
    """The megatron.yaml dict of this run (the same function `dmt generate` writes the file with), validated."""
    config = megatron_config(recipe, model, plan, recipe_hf_config(recipe))
    problems = validate_megatron_config(config, plan.gpus)
    if problems:  # the plan passed resolve_plan, so this is a rule only Megatron-Core knows
        raise UserInputError(f"megatron.yaml: {problems[0].key}", problems[0].message)
    return config


def megatron_step_peaks(recipe, model, plan, tokens) -> dict[str, tuple[int, str]]:
    """peak_live_bytes of Megatron-Core's GPT as toolkit/train.py builds it for `plan` (the generated megatron.yaml;
    its process groups must not exist yet, torch.distributed must): `forward` (one forward with labels) and `step`
    (forward and backward), each after a first forward and backward, which makes Megatron-Core's global memory
    buffer once. Run inside toolkit.compat.megatron_cpu.cuda_on_cpu() on CPU ranks."""
    import torch

    gpt = unwrapped(build(megatron_yaml_for(recipe, model, plan)))[0]
    gpt.train()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def forward():
        return gpt(tokens, positions, None, labels=tokens)

    def step():
        forward().float().mean().backward()

    step()
    peaks = {"forward": peak_live_bytes(forward), "step": peak_live_bytes(step)}
    destroy()
    return peaks


def _tokenised_data(recipe: Recipe, output_dir: Path, seq_len: int):
    """The HF backend's tokenizer and packed blocks (rank 0 builds and saves the tokenizer, the others load it)."""
    import torch.distributed as dist

    tokenizer_dir = output_dir / "tokenizer"
    for turn in (0, 1):  # rank 0 first (it also fills the datasets cache), then everyone else
        if (dist.get_rank() == 0) == (turn == 0):
            if tokenizer_dir.is_dir():
                tokenizer = hf_tokenizer(tokenizer_dir, "data.tokenizer.path")
            else:
                tokenizer = build_tokenizer(recipe, load_texts(recipe))
                tokenizer.save_pretrained(tokenizer_dir)
            train_set, _ = packed_datasets(recipe, tokenizer, seq_len)
        dist.barrier()
    return tokenizer, train_set.with_format("torch")


class GlobalBatches:
    """Which packed blocks each optimizer step trains on: a seeded permutation per epoch, read in order, so step s
    sees the same samples at any layout and after any resume. Each DP rank takes its contiguous share."""

    def __init__(self, dataset, global_batch: int, seed: int):
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self._orders: dict[int, list[int]] = {}

    def indices(self, step: int) -> list[int]:
        import torch

        n, result = len(self.dataset), []
        for position in range((step - 1) * self.global_batch, step * self.global_batch):
            epoch = position // n
            if epoch not in self._orders:
                self._orders = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()}
            result.append(self._orders[epoch][position % n])
        return result

    def tokens(self, indices: list[int]):
        return self.dataset[indices]["input_ids"]


    def rank_batch(self, step: int, dp_rank: int, per_rank: int) -> dict:
        """This DP rank's samples of the step as Megatron-Core's inputs: labels are the next token (the last position
        has none and is masked), so the loss averages the same seq_len - 1 predictions per block that HF's
        causal-LM loss does."""
        import torch

        tokens = self.tokens(self.indices(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank])
        mask = torch.ones_like(tokens, dtype=torch.float)
        mask[:, -1] = 0.0
        return {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1), "loss_mask": mask,
                "position_ids": torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)}

    def fingerprint(self, step: int, rank_batch: dict) -> str:
        return global_batch_fingerprint(self.tokens(self.indices(step)))


class BlendBatches:
    """A blend's samples (toolkit.data.blend: GPTDataset's tokens, labels, loss mask, position ids and, with
    reset_attention_mask, its attention mask) in the global order: step s trains samples (s-1)*global_batch on,
    each DP rank its contiguous share, read ahead by the recipe's data loader workers from the first step to train
    on. Nothing before that step is read, so a resume starts in constant time."""

    def __init__(self, dataset, recipe: Recipe, plan: Plan, dp_rank: int, first_step: int, last_step: int):
        import torch
        from torch.utils.data import DataLoader

        self.bound = dataset.bound  # every batch's token ids against the vocabulary (toolkit.data.blend.TokenBound)
        steps = RankSteps(plan.global_batch, dp_rank, plan.dp, first_step, last_step)
        workers = data_workers(recipe)
        loader = DataLoader(dataset, batch_sampler=steps, num_workers=workers, collate_fn=stack_samples,
                            pin_memory=recipe.data.pin_memory and torch.cuda.is_available(),
                            persistent_workers=False)
        self.step, self.batches = first_step - 1, iter(loader)

    def rank_batch(self, step: int, dp_rank: int, per_rank: int) -> dict:
        if step != self.step + 1:
            raise RuntimeError(f"the blend's batches are read in order: step {step} after {self.step}")
        self.step = step
        batch = next(self.batches)
        self.bound.check(batch["tokens"], batch.pop("dataset_id", None))
        return batch

    def fingerprint(self, step: int, rank_batch: dict) -> str:
        """The global batch's data fingerprint from every DP rank's share (a collective over the DP group)."""
        from megatron.core import parallel_state

        samples = BatchFingerprints()
        samples.add(rank_batch["tokens"])
        return samples.digest(group=parallel_state.get_data_parallel_group())


def _micro_batches(rank_batch: dict, micro: int, config: dict) -> list[dict]:
    """A rank's batch cut into Megatron-Core's micro-batches (on this rank's CP share and device)."""
    import torch

    batches = []
    for start in range(0, rank_batch["tokens"].shape[0], micro):
        batch = {key: value[start:start + micro] for key, value in rank_batch.items()}
        if config["transformer_config"]["context_parallel_size"] > 1:
            from megatron.core.utils import get_batch_on_this_cp_rank

            batch = get_batch_on_this_cp_rank(batch)
        if torch.cuda.is_available():
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        batches.append(batch)
    return batches


def forward_step(data_iterator, model, loss_factor: float | None = None):
    """Megatron-Core's forward step contract: (output, loss_func), loss_func -> (loss sum, tokens, logged).
    `loss_factor`: a fault the tests inject (toolkit.runtime.faults)."""
    import torch

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])

    def loss_func(per_token_loss):
        mask = batch["loss_mask"].view(-1).float()
        loss_sum = torch.sum(per_token_loss.view(-1).float() * mask)
        if loss_factor is not None:
            loss_sum = loss_sum * loss_factor
        tokens = mask.sum().to(torch.int)
        return loss_sum, tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}

    return output, loss_func


def _global_loss(losses: list[dict]) -> float:
    """Mean token loss of the whole global batch: sums from the last pipeline stage's first TP rank of every
    DP (and CP) replica, added over all ranks."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    total = torch.zeros(2, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for record in losses:
            total += record["lm loss"].detach().to("cpu", torch.float64)
    device_total = total.cuda() if torch.cuda.is_available() else total
    dist.all_reduce(device_total)
    total = device_total.cpu()
    return float(total[0] / total[1])


def train(recipe: Recipe, model_spec: ModelSpec, plan: Plan, output_dir: Path, resume: str | None,
          config: dict | None = None, throughput=None, watch=None) -> dict:
    """Run training on this rank; returns a summary (steps, last loss). `config` is the generated megatron.yaml
    (checked against plan.json by toolkit.validate.generated); without it the generator makes it from the recipe.
    `throughput` (toolkit.runtime.metrics.Throughput, from train.py) turns step times into tokens/s and MFU; `watch`
    is this rank's toolkit.runtime.supervision.TrainingWatchdog."""
    check_world(plan)
    watch = watch or TrainingWatchdog(output_dir, 0)  # inactive: only the phases' fault injection
    config = config if config is not None else megatron_yaml_for(recipe, model_spec, plan)
    identity = run_identity(recipe, plan)
    resume_path = resume_checkpoint(output_dir, resume, identity, trim=recipe.checkpoint.local is None)
    output_dir.mkdir(parents=True, exist_ok=True)
    init_distributed()
    with device_context():
        if recipe.data.blend:  # Megatron-Core's own datasets (rank 0 builds the index cache, the others wait)

            train_set, _ = build_datasets(recipe, plan.seq_len, plan.global_batch, output_dir,
                                          config["model"]["vocab_size"])
            if recipe.data.reset_attention_mask and config["transformer_config"].get("transformer_impl") != "local":
                # the layer specs' attention is causal; Transformer Engine's kernels take documents apart only from
                # THD packed-sequence parameters, which this loop does not build
                log.warning("data.reset_attention_mask: GPTDataset's document mask is applied by the local "
                            "attention only; with Transformer Engine attention stays causal over the whole sequence")
        else:
            tokenizer, train_set = _tokenised_data(recipe, output_dir, plan.seq_len)
            if len(tokenizer) > config["model"]["vocab_size"]:
                raise UserInputError("model.config.vocab_size", f"{config['model']['vocab_size']} < tokenizer size "
                                                                 f"{len(tokenizer)}")
        hf_config = recipe_hf_config(recipe)
        return _train_loop(recipe, plan, config, output_dir, train_set, resume_path, identity, hf_config, throughput,
                           watch, resume in ("auto", "latest"))


def _optimizer_step(setup, guard, saves, step: int, loss: float, data_sha: str) -> float:
    """Megatron-Core's optimizer step with the guard's verdict between the gradient norm and the update; returns the
    norm. The step is ChainedOptimizer.step's own order (toolkit.compat.megatron_seams.chained_step): its one global
    norm, which clipping needs anyway (a non-finite gradient anywhere makes it inf or nan), is the guard's one look at
    the gradients. A verdict leaves the update and the scheduler step out (`stop` raises first; a rollback waits for
    the save in flight, then reloads); an update first waits for a background save's copy of the state
    (`saves.handed_over`)."""
    def proceed(grad_norm: float) -> bool:
        verdict = guard.judge(step, loss, grad_norm)
        if verdict.action is None:
            return True
        if verdict.action == "rollback":  # the save in flight, once complete, is the checkpoint to go back to
            saves.wait(step)
        guard.act(step, verdict, data_sha)
        return False

    grad_norm, updated = chained_step(setup.optimizer, read_grad_norm, proceed, saves.handed_over)
    if updated:
        setup.scheduler.step(increment=1)
    return grad_norm


def _resume(recipe, plan, setup, output_dir: Path, resume_path: Path | None, identity: dict,
            resuming: bool) -> tuple[int, LocalCheckpoints | None]:
    """The step training continues after, and the run's local checkpoints (checkpoint.local, else None): a resume
    (--resume auto or latest) reads the local checkpoint when every rank has one newer than the persistent
    `resume_path`, else that (and the local ones are removed); rank 0 records a local one in incident.json
    (`local_resume`) and trims metrics.jsonl to the step resumed."""
    import torch.distributed as dist

    if recipe.checkpoint.local is None:
        return (load_checkpoint(setup, resume_path, plan) if resume_path else 0), None
    local = LocalCheckpoints(recipe.checkpoint.local, output_dir, recipe.name, plan, identity)
    persistent = read_manifest(resume_path)["step"] if resume_path else None
    newer = local.latest() if resuming else -1
    step = local.load(setup) if newer > (persistent or 0) else None
    if step is not None:
        if dist.get_rank() == 0:
            append_incident(output_dir, {"event": "local_resume", "step": step, "dir": str(local.root),
                                         "persistent": resume_path.name if resume_path else None})
        log.info("resumed from the local checkpoint of step %d (persistent: %s)", step, persistent)
    else:
        local.clear()
        step = load_checkpoint(setup, resume_path, plan) if resume_path else None
    trim_metrics(output_dir, step)
    return step or 0, local


def _train_loop(recipe, plan, config, output_dir, train_set, resume_path, identity, hf_config, throughput,
                watch, resuming: bool) -> dict:
    import functools
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    setup = build(config)
    step, local = _resume(recipe, plan, setup, output_dir, resume_path, identity, resuming)
    write_expert_layout(unwrapped(setup), output_dir)
    routing = RoutingMetrics(unwrapped(setup), setup.transformer_config)
    rank0 = dist.get_rank() == 0
    guard = StepGuard(LossGuard.from_recipe(recipe.training.guard, guard_window(resume_path)), output_dir,
                      dist.get_rank())
    watch.start()
    last = config["schedule"]["train_iters"]
    batches = BlendBatches(train_set, recipe, plan, parallel_state.get_data_parallel_rank(), step + 1, last) \
        if recipe.data.blend else GlobalBatches(train_set, plan.global_batch, recipe.training.seed)
    metrics = MetricsWriter(output_dir, throughput or Throughput(plan.global_batch * plan.seq_len)) if rank0 else None
    wandb = None
    if rank0 and "wandb" in recipe.training.report_to:
        configure_wandb(recipe.training.report_to, output_dir)
        wandb = WandbRun(recipe.name, output_dir, {"plan": plan.as_dict(), "recipe": recipe.name})
    saves = CheckpointSaves(config["schedule"]["async_save"], metrics, watch, save_wait_s(recipe))
    saves.start()
    forward_backward = get_forward_backward_func()
    dp_rank, per_rank = parallel_state.get_data_parallel_rank(), plan.micro_batch * plan.grad_accum
    save_every, loss, last = recipe.training.save_steps, None, config["schedule"]["train_iters"]
    if metrics:
        metrics.mark(step)
    profiler = StepProfiler.from_recipe(recipe, output_dir, dist.get_rank())  # training.profile (inactive: off)
    while step < last:
        step += 1
        profiler.begin_step(step)
        watch.phase(step, "train")
        fetching = time.perf_counter()
        with profiler.span(DATA):
            rank_batch = batches.rank_batch(step, dp_rank, per_rank)
            micro = _micro_batches(rank_batch, plan.micro_batch, config)
        if metrics:
            metrics.add_data_wait(time.perf_counter() - fetching)
        learning_rate = setup.optimizer.param_groups[0]["lr"]
        for chunk in setup.model:
            chunk.zero_grad_buffer()
        setup.optimizer.zero_grad()
        iterators = [iter(micro) for _ in setup.model] if len(setup.model) > 1 else iter(micro)
        watch.phase(step, "forward-backward")
        losses = forward_backward(forward_step_func=functools.partial(forward_step, loss_factor=faults.loss_factor(step)),
                                  data_iterator=iterators, model=setup.model, num_microbatches=plan.grad_accum,
                                  seq_length=plan.seq_len, micro_batch_size=plan.micro_batch, forward_only=False)
        watch.phase(step, "optimizer")
        loss = _global_loss(losses)
        moe = routing.collect(step, plan.grad_accum) if routing else {}
        digest = batches.fingerprint(step, rank_batch)
        guard.begin_step()
        with profiler.span(OPTIMIZER):
            grad_norm = _optimizer_step(setup, guard, saves, step, loss, digest)
        guard.end_step(step, loss)
        target = guard.rolling_back()
        if target is not None:
            guard.rolled_back(step)
            load_checkpoint(setup, target, plan)
        logged = step % recipe.training.logging_steps == 0
        memory = gpu_memory_of_ranks() if logged else {}  # a collective (GPUs only): every rank takes part
        if metrics and logged:
            record = write_step_record(metrics, guard, step, loss, grad_norm, learning_rate,
                                       {**metrics.measure(step), **memory}, digest, **moe)
            if wandb is not None:
                wandb.log(record)
        inprocess.record_resumed(output_dir, step)  # the first step after an in-process restart: its time
        saves.poll()  # a background write that finished is completed (manifest, `latest`) now
        stop = save_and_exit_requested(output_dir)
        if stop or step == last or (save_every and step % save_every == 0):
            with profiler.span(CHECKPOINT):
                save_checkpoint(setup, output_dir, step, plan, identity, saves, hf_config, watch, guard.window())
        elif local is not None and local.due(step):
            watch.phase(step, "save")
            with profiler.span(CHECKPOINT):
                saves.handed_over()  # (a background save's copy is complete before NVRx copies the state)
                local.save(setup, step)
        else:
            watch.phase(step, "log")
        if stop:
            break
    profiler.close()  # a window that reached the last step is written now
    saves.close(step)  # the last save complete before the run ends
    if wandb is not None:
        wandb.finish()
    destroy()
    return {"global_step": step, "train_loss": loss}
