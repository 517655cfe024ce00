"""`primerl trainer`: the RL trainer process.

Step convention (docs/trainer.md): holding policy version k (the weights after k optimizer steps; version 0 is the
initial model), the trainer waits for `rollouts/step_<k>/`, trains on it and publishes `weights/step_<k+1>/`
(policy version k + 1). Metrics, weights and checkpoints are all labelled with the number of completed steps, so the
metrics line `"step": k + 1` is the step that trained on `rollouts/step_<k>` (also logged as `rollout_step`).
Launch with torchrun for several ranks (FSDP2); a single process otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from primerl.config import config_from_argv
from primerl.config.trainer import LossConfig, ReferenceConfig, RolloutDataConfig, TrainerConfig
from primerl.cpu import keep_freed_memory
from primerl.storage import storage_failure
from primerl.trainer.core import (
    MicroBatch,
    StepLoss,
    Trainer,
    TrainerParts,
    auto_micro_batch_rows,
    micro_batches,
    setup_logging,
)
from primerl.trainer.dist import all_reduce_sum, wants_cuda
from primerl.trainer.loss import (
    LossInputs,
    LossOutput,
    build_loss,
    normalization_weights,
    sample_loss_tokens,
    token_sum,
)
from primerl.trainer.model import PolicyOutput
from primerl.trainer.optim import allocate_state
from primerl.trainer.reference import build_reference, fill_reference_logprobs, reference_kl
from primerl.transport.checkpoints import prune_batches
from primerl.transport.rollouts import (
    Sample,
    pack_samples,
    read_batch,
    split_rows,
    wait_for_batch,
)

log = logging.getLogger(__name__)


def fake_rows(cfg: RolloutDataConfig, vocab_size: int, step: int, seed: int, world_size: int, rank: int):
    """Random samples for `step` (the same on every rank and after a resume), packed and dealt like a real batch.

    Half of each sample is prompt, half completion; advantages are standard normal per sample. The inference
    log-probs are left at 0: `fill_on_policy_logprobs` replaces them with the current policy's own."""
    rng = np.random.default_rng([seed, step])
    samples = []
    prompt = cfg.fake_sample_tokens // 2
    for _ in range(cfg.fake_samples):
        ids = rng.integers(0, vocab_size, cfg.fake_sample_tokens).tolist()
        mask = [0] * prompt + [1] * (cfg.fake_sample_tokens - prompt)
        samples.append(Sample(ids, mask, [0.0] * len(ids), float(rng.standard_normal())))
    packed = pack_samples(samples, cfg.fake_seq_len)
    return split_rows(packed.arrays, world_size)[rank]


def warm_up(trainer: Trainer, step_loss: StepLoss, tokens: int, micro_batch_rows: int | None) -> None:
    """`Trainer.warm_up` on one micro-batch of dummy rows of `tokens` tokens (half of each completion, advantage 0),
    as many rows as a step's micro-batch holds: on a GPU the fused log-prob kernels are compiled for the shape of a
    step's full chunks (one row would be a smaller shape), on the CPU that is one row. Logged."""
    started = time.perf_counter()
    rows = micro_batch_rows or auto_micro_batch_rows(tokens, trainer.device)
    ids = [0] * tokens
    mask = [0] * (tokens // 2) + [1] * (tokens - tokens // 2)
    packed = pack_samples([Sample(ids, mask, [0.0] * tokens, 0.0) for _ in range(rows)], tokens)
    trainer.warm_up(micro_batches(packed.arrays, rows, trainer.device), step_loss)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    log.info("warmed up on %d dummy row(s) of %d tokens in %.1fs (before the first batch)", rows, tokens,
             time.perf_counter() - started)


def make_rl_loss(loss_fn: Callable[[LossInputs], LossOutput], reference: ReferenceConfig | None = None) -> StepLoss:
    """Adapt an RL loss (primerl.trainer.loss contract) to the trainer's (forward output, micro-batch) call; with a
    `reference` whose kl_coef is set, add its KL penalty (on micro-batches that carry `ref_logprobs`)."""
    kl_coef = reference.kl_coef if reference is not None else 0.0

    def step_loss(out: PolicyOutput, mb: MicroBatch) -> LossOutput:
        inputs = LossInputs(
            logprobs=out.logprobs,
            inference_logprobs=mb["inference_logprobs"],
            advantages=mb["advantages"],
            loss_mask=mb["loss_mask"],
            entropy=out.entropy,
            sample_index=mb["sample_index"],
            loss_weights=mb.get("loss_weights"),
            ref_logprobs=mb.get("ref_logprobs"),
        )
        result = loss_fn(inputs)
        if kl_coef and inputs.ref_logprobs is not None:
            kl = reference_kl(inputs.logprobs, inputs.ref_logprobs, reference.estimator)
            penalty = token_sum(kl, inputs.loss_mask, inputs.loss_weights)
            result.loss_sum = result.loss_sum + (kl_coef * penalty).to(result.loss_sum.dtype)
            result.metrics["ref_kl"] = (kl.detach() * inputs.loss_mask).sum()
        return result

    return step_loss


def fill_loss_weights(batch: list[MicroBatch], loss: LossConfig, device: torch.device) -> None:
    """`mb["loss_weights"]` for a sequence or constant normalisation (`normalization_weights`), from the samples and
    loss tokens of the whole step (all micro-batches, all ranks); nothing for the token normalisation."""
    normalize = getattr(loss, "normalize", "token")
    if normalize == "token":
        return
    samples = sum(int((sample_loss_tokens(mb["sample_index"], mb["loss_mask"]) > 0).sum()) for mb in batch)
    tokens = sum(int(mb["loss_mask"].sum()) for mb in batch)
    counts = all_reduce_sum(torch.tensor([float(samples), float(tokens)], dtype=torch.float64, device=device))
    num_samples, num_tokens = counts.tolist()
    for mb in batch:
        mb["loss_weights"] = normalization_weights(mb["sample_index"], mb["loss_mask"], num_samples, num_tokens,
                                                   normalize, loss.normalize_tokens)


def train(cfg: TrainerConfig) -> None:
    parts = TrainerParts.of(cfg)
    step_loss = make_rl_loss(build_loss(cfg.loss), cfg.reference)
    trainer = Trainer(parts, source="trainer")
    reference = build_reference(trainer) if cfg.reference.enabled else None
    log.info("loss %s | reference KL %s", cfg.loss.type,
             f"kl_coef {cfg.reference.kl_coef} ({cfg.reference.estimator})" if reference is not None else "off")
    rank, world = trainer.dist.rank, trainer.dist.world_size
    try:
        step, _ = trainer.resume()
        allocate_state(trainer.optimizer)  # a fresh run's optimizer state, before the wait for the first batch
        if cfg.train.warm_up_tokens and not cfg.data.fake:
            warm_up(trainer, step_loss, cfg.train.warm_up_tokens, cfg.train.micro_batch_rows)
        while cfg.train.max_steps is None or step < cfg.train.max_steps:
            if cfg.data.fake:
                vocab = trainer.policy.causal_lm.config.vocab_size
                arrays, temperature, wait_s = fake_rows(cfg.data, vocab, step, cfg.train.seed, world, rank), 1.0, 0.0
            else:
                path, wait_s = wait_for_batch(
                    cfg.run_dir,
                    step,
                    cfg.data.poll_interval_s,
                    cfg.data.timeout_s,
                    on_wait=lambda p, waited: log.info("waiting for %s (%.0fs so far)", p, waited),
                )
                batch = read_batch(path, rank, world)
                arrays, temperature = batch.arrays, batch.meta["temperature"]
            batch_tensors = micro_batches(arrays, cfg.train.micro_batch_rows, trainer.device)
            if cfg.data.fake:
                fill_on_policy_logprobs(trainer, batch_tensors)
            fill_loss_weights(batch_tensors, cfg.loss, trainer.device)
            if reference is not None:
                fill_reference_logprobs(trainer, reference, batch_tensors, temperature)
            metrics = trainer.step(batch_tensors, step_loss, temperature)
            metrics.update(wait_s=wait_s, rollout_step=step)
            step += 1
            is_last = cfg.train.max_steps is not None and step >= cfg.train.max_steps
            trainer.finish_step(step, metrics, {"next_rollout_step": step}, is_last)
            if trainer.dist.is_main and not cfg.data.fake:
                prune_batches(cfg.run_dir, cfg.ckpt.keep_rollouts, step, trainer.checkpointer.complete_steps())
    finally:
        trainer.close()


@torch.no_grad()
def fill_on_policy_logprobs(trainer: Trainer, batch: list[MicroBatch]) -> None:
    """Fake data: pretend the current policy sampled the tokens (inference log-probs = the trainer's own)."""
    for mb in batch:
        out = trainer.forward(mb, 1.0)
        mb["inference_logprobs"] = out.logprobs.float() * mb["loss_mask"]


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config_from_argv(TrainerConfig, argv, prog="primerl trainer")
    setup_logging(int(os.environ.get("RANK", "0")), "trainer")
    if not wants_cuda(cfg.train.device):  # a GPU trainer's large blocks are the device's
        keep_freed_memory()
    try:
        train(cfg)
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if (line := storage_failure(e)) is None:
            raise
        print(f"primerl trainer: {line}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
