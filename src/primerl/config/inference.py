"""Config of `primerl inference`: which model to serve, with which engine, where to listen, and the admin token."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from primerl.config.base import ProcessConfig, Section
from primerl.config.common import ModelConfig
from primerl.transport.weight_transfer.modes import WeightTransfer, transfer_mode

LogLevel = Literal["debug", "info", "warning", "error"]


class VLLMSection(Section):
    """Options only the vLLM engine reads."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of GPU memory vLLM may claim")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model replica is sharded over")
    enforce_eager: bool = Field(False, description="disable CUDA graphs (faster start, slower decode)")
    sleep_level: int = Field(
        0,
        ge=0,
        le=1,
        description="1 = start vLLM with sleep mode: /admin/pause then offloads the weights to CPU memory and frees "
        "the KV cache (GPU memory for a trainer on the same GPU), /admin/resume brings them back; 0 = pause only stops "
        "scheduling",
    )
    detokenize: bool = Field(
        False,
        description="have vLLM decode every reply's text as it streams; primerl's routes decode with the server's "
        "own tokenizer, so this is off and turned on only for a request with stop strings (which vLLM matches on "
        "text)",
    )
    stream_interval: int = Field(
        16,
        ge=1,
        description="vLLM hands this process a request's tokens every N sampled tokens (and at its end), not after "
        "every decode step: a batch of 256 then costs this process's output handling 1/N of the wake-ups; each token "
        "keeps the policy version that sampled it either way; 1 = every token as it is sampled",
    )


class BroadcastReceiverSection(Section):
    """Where the trainer's weight group is (`weight_transfer = "broadcast"`). The trainer decides everything else
    (backend, buckets); rl copies these from `trainer.weights.broadcast`."""

    host: str = Field("127.0.0.1", description="address of trainer rank 0 (its weight store)")
    port: int = Field(0, ge=0, le=65535, description="port of the trainer's weight store")
    init_timeout_s: float = Field(600.0, gt=0, description="how long to keep trying to join after the engine started")
    timeout_s: float = Field(120.0, gt=0, description="how long one handshake or collective may wait for the trainer")


class InferenceConfig(ProcessConfig):
    """Serve a model over the OpenAI-compatible HTTP API (chat completions, the token route, admin routes)."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="the model to serve")
    engine: Literal["hf", "vllm"] = Field("hf", description="hf = embedded engine (CPU or GPU); vllm = GPU, needs vllm")
    device: str = Field("auto", description="hf engine: auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    served_model_name: str | None = Field(None, description="name clients pass as `model` (default: model.name)")
    host: str = Field("127.0.0.1", description="bind address; loopback unless you mean to expose the server")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 = any free port, printed at start)")
    admin_token: SecretStr | None = Field(
        None,
        description="bearer token for /admin/*; read from PRIMERL_ADMIN_TOKEN; generated at start when unset",
    )
    admin_token_file: Path | None = Field(
        None, description="write the admin token in use to this file (mode 0600) so a launcher can read it"
    )
    max_model_len: int | None = Field(
        None, ge=1, description="context length (prompt + completion); default: the model's own limit"
    )
    keep_alive_s: float = Field(
        75.0,
        ge=1,
        description="keep idle client connections open this long; keep it longer than every client's idle-connection "
        "expiry (httpx: 5 s), so no client sends a request into a connection the server is closing",
    )
    max_batch_size: int = Field(32, ge=1, description="sequences decoded together at most")
    threads: int | None = Field(
        None, ge=1, description="hf engine: CPU threads of torch's intra-op pool (None: torch's default, one per core)"
    )
    decode_steps: int = Field(
        8,
        ge=1,
        le=64,
        description="hf engine: decode steps run back to back on the device, sampling included, before the host "
        "looks at the tokens (1 = one step at a time; rows with top_p < 1 or top_k always go one step at a time)",
    )
    overlap: bool | None = Field(
        None,
        description="hf engine: launch the next chunk of decode steps before the host reads the last one's tokens "
        "while no request waits for a row (the device decodes while the host records and schedules); None = on for "
        "CUDA (P3 on an H200: SmolLM2 38k -> 47.7k tokens/s), off on CPU, where decoding does not run apart from "
        "the host",
    )
    compile: bool | None = Field(
        None,
        description="hf engine: torch.compile one decoder layer of the decode step (fused kernels; on CUDA then "
        "captured in CUDA graphs), at start; None = on for CUDA (SmolLM2 decode 1.7x on an H200, ~12 s at start), "
        "off on CPU (5 %, ~20 s at start)",
    )
    max_n: int = Field(64, ge=1, description="largest `n` (samples per request) the server accepts")
    max_concurrent_requests: int = Field(
        1024, ge=1, description="completion requests in flight at most; more are refused at once with 429"
    )
    seed: int = Field(
        0, description="seeds the engine's sampling for requests that bring no seed of their own (hf: the seed each "
        "such request draws; vllm: the engine's global generator)"
    )
    log_level: LogLevel = Field("info", description="debug | info | warning | error")
    vllm: VLLMSection = Field(default_factory=VLLMSection, description="vLLM engine options")
    weight_transfer: WeightTransfer = Field(
        "filesystem",
        description="broadcast = join the trainer's weight group at start and apply every version it sends; "
        "/admin/update_weights then confirms them; shared = versions with a SHARED marker are copied from the "
        "trainer's buffer on this device (filesystem snapshots load as always)",
    )
    weight_broadcast: BroadcastReceiverSection = Field(
        default_factory=BroadcastReceiverSection, description="the trainer's weight group (weight_transfer = broadcast)"
    )

    @model_validator(mode="after")
    def _group_needs_port(self) -> InferenceConfig:
        transfer_mode(self.weight_transfer).check_group_port(self.weight_broadcast.port, "weight_transfer",
                                                             "weight_broadcast.port")
        return self
