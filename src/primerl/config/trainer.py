"""Config of the RL trainer (`primerl trainer`) and the training sections it shares with `primerl sft`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from primerl.config.base import ProcessConfig, Section
from primerl.config.common import ModelConfig, WandbConfig
from primerl.transport.weight_transfer.modes import WeightTransfer, transfer_mode

Attention = Literal["auto", "varlen", "flash_attention_2", "flex_attention", "sdpa", "eager"]


class TrainingConfig(Section):
    """How the model is trained: steps, micro-batches, device, attention kernel, memory/speed switches."""

    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps (None: RL runs on)")
    micro_batch_rows: int | None = Field(
        None, ge=1, description="packed rows per forward/backward pass on each rank (None: 1 on CPU; on a GPU as many "
        "as hold 16,384 tokens)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    attention: Attention = Field(
        "auto",
        description="kernel for packed rows: auto = flash_attention_2 if flash-attn is installed, else torch's varlen "
        "flash kernel (or flex_attention) on GPU, sdpa (block-diagonal mask) on CPU",
    )
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer in backward")
    compile: bool = Field(False, description="torch.compile each decoder layer")
    threads: int | None = Field(
        None, ge=1, description="CPU threads of torch's intra-op pool (None: torch's default, one per core)"
    )
    backward_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="dtype of the backward pass's matmuls; auto = bfloat16 for a float32 model on a CPU with "
        "bfloat16 dot products (forward, and so the log-probs, stay float32), else the compute dtype",
    )
    logprob_chunk_tokens: int = Field(
        4096, ge=1, description="tokens per chunk of the fused lm-head/log-prob pass (bounds the logits in memory)"
    )
    width_multiple: int = Field(
        64, ge=1, description="the columns of a micro-batch (its padding trimmed) and the tokens of the log-prob head "
        "are rounded up to a multiple of this: a CPU backend caches a kernel for every new shape, so a long run with "
        "every width its own would grow (1: no rounding)",
    )
    seed: int = Field(0, description="seed for initialisation of new parameters (LoRA) and fake data")
    deterministic: bool = Field(
        False, description="torch.use_deterministic_algorithms(True) (`rl --deterministic` sets it)"
    )
    weight_checksum: bool = Field(
        False, description="log `weight_checksum`, the sha256 of the weights' bytes after each step (on a GPU it "
        "copies every weight to the host; `rl --deterministic` turns it on)"
    )
    warm_up_tokens: int | None = Field(
        None, ge=0, description="RL: before its first batch, one forward and backward over a micro-batch of dummy "
        "rows of this many tokens whose gradients are dropped, so that the first step finds its memory mapped and, on "
        "a GPU, its kernels compiled (0 or None: none; `rl` makes None seq_len, or 0 where vLLM shares the "
        "trainer's GPU)",
    )
    peak_flops: float | None = Field(
        None, gt=0, description="peak FLOP/s of one device for MFU; None = known table by device name (bf16 dense)"
    )


class LoraConfig(Section):
    """Low-rank adapters through peft. Exported weights are merged, so inference never sees adapters."""

    enabled: bool = Field(False, description="train LoRA adapters instead of all weights")
    rank: int = Field(16, ge=1, description="adapter rank r")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: delta W = (alpha / r) B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="names of the linear modules that get adapters",
    )


class OptimizerConfig(Section):
    """AdamW on fp32 master weights, with global-norm gradient clipping."""

    lr: float = Field(1e-6, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm (None: no clipping)")


class SchedulerConfig(Section):
    """Learning-rate schedule as a factor on `optim.lr`: linear warm-up, then constant, linear or cosine decay."""

    kind: Literal["constant", "linear", "cosine"] = Field("constant", description="shape after warm-up")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up from 0")
    decay_steps: int | None = Field(
        None, ge=1, description="steps of decay after warm-up (linear/cosine); None = train.max_steps - warmup_steps"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of the peak (linear/cosine)")


class CheckpointConfig(Section):
    """Full training state (torch distributed checkpoint) under `<run>/checkpoints/step_<k>/trainer/`."""

    interval: int | None = Field(None, ge=1, description="save every this many steps (None: only at the end)")
    keep_last: int | None = Field(2, ge=1, description="keep the newest this many checkpoints (None: all)")
    keep_rollouts: int | None = Field(
        100, ge=0, description="RL: of the rollout batches (`rollouts/step_<n>/`) that no resume can read again "
        "(trained on, and older than every checkpoint kept), keep the newest this many and remove the rest, so a long "
        "run's directory stays bounded (None: keep all)",
    )
    resume: int | Literal["latest"] | None = Field(
        None, description="resume from checkpoint step k, or the latest complete one"
    )
    save_at_end: bool = Field(True, description="save a checkpoint after the last step")


class BroadcastConfig(Section):
    """The weight group of `transfer = "broadcast"`: trainer rank 0 hosts a TCP store at host:port, the inference
    receivers join, and each new policy version is broadcast to them in buckets (docs/weights.md)."""

    host: str = Field("127.0.0.1", description="address of trainer rank 0 that the receivers connect to")
    port: int = Field(0, ge=0, le=65535, description="TCP port of the weight store (rl picks a free one when 0)")
    receivers: int = Field(1, ge=1, description="receiver ranks: 1 per embedded engine, tensor_parallel_size per vLLM")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto = nccl when every member is on its own GPU, else gloo"
    )
    bucket_mb: int = Field(512, ge=1, description="largest bucket in MiB (a bigger tensor travels alone)")
    init_timeout_s: float = Field(600.0, gt=0, description="how long to wait for the receivers to join at start")
    timeout_s: float = Field(120.0, gt=0, description="how long one handshake or collective may wait for a peer")


class WeightsConfig(Section):
    """Weight snapshots for inference under `<run>/weights/step_<k>/` (STABLE marker last)."""

    interval: int | None = Field(1, ge=1, description="export every this many steps (None: only at the end)")
    keep_last: int | None = Field(3, ge=1, description="keep the newest this many snapshots (None: all)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the exported tensors; auto = the compute dtype"
    )
    transfer: WeightTransfer = Field(
        "filesystem",
        description="filesystem = full snapshots on disk; broadcast = send each version to inference over a "
        "collective group and publish a BROADCAST marker; shared = inference on the same device copies each version "
        "from a buffer the trainer shares (CUDA IPC, or shared memory on the CPU) and a SHARED marker is published "
        "(the last step and checkpoint steps are still written in full)",
    )
    shared_timeout_s: float = Field(
        120.0, gt=0, description="shared: wait this long for inference to apply a version before writing the next"
    )
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig, description="the weight group (broadcast)")

    @model_validator(mode="after")
    def _group_needs_port(self) -> WeightsConfig:
        transfer_mode(self.transfer).check_group_port(self.broadcast.port, "weights.transfer", "weights.broadcast.port")
        return self


Normalize = Literal["token", "sequence", "constant"]


class _BuiltinLoss(Section):
    """What every built-in loss shares: how its per-token terms are summed into the step's loss (docs/algorithms.md)."""

    normalize: Normalize = Field(
        "token",
        description="token = the mean over every loss token of the step; sequence = the mean over samples of each "
        "sample's mean; constant = the sum over each sample's tokens divided by normalize_tokens, averaged over "
        "samples (Dr. GRPO)",
    )
    normalize_tokens: int | None = Field(
        None, ge=1, description="normalize = constant: the divisor of each sample's token sum (e.g. max_tokens)"
    )

    @model_validator(mode="after")
    def _constant_needs_tokens(self):
        if self.normalize == "constant" and self.normalize_tokens is None:
            raise ValueError("normalize = 'constant' needs normalize_tokens (e.g. the sampling max_tokens)")
        return self


class MaskedImportanceLoss(_BuiltinLoss):
    """Token-level importance-weighted policy gradient that masks tokens whose ratio p/q left its band (default)."""

    type: Literal["masked_importance"] = "masked_importance"
    pos_ratio_low: float = Field(0.125, ge=0, le=1, description="A >= 0: tokens with p/q below this are masked")
    pos_ratio_high: float = Field(8.0, ge=1, description="A >= 0: tokens with p/q above this are masked")
    neg_ratio_low: float = Field(0.125, ge=0, le=1, description="A < 0: tokens with p/q below this are masked")
    neg_ratio_high: float = Field(8.0, ge=1, description="A < 0: tokens with p/q above this are masked")
    kl_coef: float = Field(0.0, ge=0, description="weight of the mismatch KL to the sampling policy (k3)")


class PPOClipLoss(_BuiltinLoss):
    """PPO's clipped surrogate with the sampling policy as the old policy; asymmetric clip (clip-higher)."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, lt=1, description="the ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="the ratio is clipped above at 1 + clip_high (DAPO's 0.28)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the mismatch KL to the sampling policy (k3)")


class GSPOLoss(_BuiltinLoss):
    """GSPO: PPO's clipped surrogate on the sequence-level ratio (the geometric mean of the tokens' ratios)."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, lt=1, description="the sequence ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(4e-4, ge=0, description="the sequence ratio is clipped above at 1 + clip_high")
    normalize: Normalize = Field("sequence", description=_BuiltinLoss.model_fields["normalize"].description)


class CISPOLoss(_BuiltinLoss):
    """CISPO: REINFORCE on every token, weighted by the clipped importance ratio with its gradient stopped."""

    type: Literal["cispo"] = "cispo"
    clip_low: float = Field(1.0, ge=0, le=1, description="the weight is clipped below at 1 - clip_low (1: no bound)")
    clip_high: float = Field(0.28, ge=0, description="the weight is clipped above at 1 + clip_high")


class CustomLoss(Section):
    """Your own loss: `path` names a callable `module:function`, called with the batch tensors and `kwargs`."""

    type: Literal["custom"] = "custom"
    path: str = Field("primerl.trainer.loss:masked_importance_loss", description="import path module:callable")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the loss")


def _untyped_loss(value: Any) -> Any:
    """A table without `type`: a custom loss when it names `path` or `kwargs` (configs written before losses had a
    type; the path defaults to the masked importance loss, as it always did), else the default loss."""
    if isinstance(value, dict) and "type" not in value:
        return {"type": "custom" if "path" in value or "kwargs" in value else "masked_importance", **value}
    return value


LossConfig = Annotated[
    MaskedImportanceLoss | PPOClipLoss | GSPOLoss | CISPOLoss | CustomLoss,
    Field(discriminator="type"),
    BeforeValidator(_untyped_loss),
]


class ReferenceConfig(Section):
    """A KL penalty to a frozen copy of the initial policy, whose log-probs the trainer computes itself."""

    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the reference model (0: no reference model)")
    estimator: Literal["k3", "k2", "k1"] = Field(
        "k3",
        description="per-token estimate of KL(p || ref) from tokens sampled by p: k3 = e^-d - 1 + d (non-negative, "
        "GRPO's), k2 = d^2 / 2, k1 = d, with d = log p - log ref",
    )

    @property
    def enabled(self) -> bool:
        return self.kl_coef > 0


class RolloutDataConfig(Section):
    """Where the RL trainer gets its batches: `<run>/rollouts/step_<n>/`, or generated fake data."""

    fake: bool = Field(False, description="train on random sequences instead of waiting for the orchestrator")
    poll_interval_s: float = Field(0.05, gt=0, description="how often to look for the next batch (a stat per look)")
    timeout_s: float | None = Field(None, gt=0, description="give up when a batch does not come in time")
    fake_samples: int = Field(8, ge=1, description="fake mode: samples per step")
    fake_sample_tokens: int = Field(64, ge=2, description="fake mode: tokens per sample (half prompt, half completion)")
    fake_seq_len: int = Field(256, ge=2, description="fake mode: packed row length")


class TrainerConfig(ProcessConfig):
    """The RL trainer: waits for `rollouts/step_<n>/`, trains on it, writes `weights/step_<n+1>/`."""

    run_dir: Path = Field(Path("runs/debug"), description="the run directory shared with the other processes")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy to train")
    train: TrainingConfig = Field(default_factory=TrainingConfig, description="steps, micro-batches, kernels")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters")
    optim: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="learning-rate schedule")
    loss: LossConfig = Field(
        default_factory=MaskedImportanceLoss,
        description="RL loss, by `type`: masked_importance, ppo_clip, gspo, cispo, custom (docs/algorithms.md)",
    )
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="KL to the frozen initial policy")
    data: RolloutDataConfig = Field(default_factory=RolloutDataConfig, description="batches")
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="weight export for inference")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging (off by default)")

    @model_validator(mode="after")
    def _decay_needs_length(self) -> TrainerConfig:
        check_schedule(self.scheduler, self.train)
        return self


def check_schedule(scheduler: SchedulerConfig, train: TrainingConfig) -> None:
    """A decaying schedule needs to know how long it decays."""
    if scheduler.kind != "constant" and scheduler.decay_steps is None:
        if train.max_steps is None:
            raise ValueError(f"scheduler.kind={scheduler.kind!r} needs scheduler.decay_steps or train.max_steps")
        if train.max_steps <= scheduler.warmup_steps:
            raise ValueError("train.max_steps must exceed scheduler.warmup_steps for a decaying schedule")
