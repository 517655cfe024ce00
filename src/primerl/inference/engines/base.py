"""The contract between the inference server and a generation engine.

An engine works on token ids: it takes a prompt as ids, streams back the sampled ids with their logprobs and the
policy version that produced each, and ends every request with exactly one `Finish`. It owns the model weights
(reloaded in place by `update_weights`) and can be paused between decode steps. Tokenization and chat templates
belong to the caller; the engine exposes its `tokenizer` and `eos_token_ids` so the caller can use them.

Semantics every engine keeps:

- `generate` is an async generator: `TokenEvent`s as tokens are sampled, then one `Finish`. Closing the generator
  early (the consumer is cancelled or breaks out) aborts the request and frees its slot.
- Token ids include the token that ended the request (an eos/stop token id, or the token that completed a stop
  string); `Finish.stop` names what matched, and the caller cuts the text before the first occurrence of a matched
  stop string.
- `TokenEvent.logprob` is the log-probability of the sampled token under the distribution it was sampled from:
  softmax(logits / temperature), restricted to the top-k / top-p set and renormalized. With top_k=-1 and top_p=1
  (the RL setting) this equals what a trainer computes from logits / temperature. For greedy requests
  (temperature 0) it is the log-probability under softmax(logits), the untempered distribution.
- A request with a `seed` gets the same tokens for the same prompt, parameters and weights, whatever else is in the
  batch. A request without one is sampled from the engine's own seeded stream (reproducible for one engine seed and
  one arrival order at most; vLLM's batched sampler does not promise even that).
- `prompt_tokens + completion_tokens <= max_model_len`; a longer prompt (or an empty one) raises `ValueError` from
  `generate` before anything is yielded.
- `update_weights` applies new weights between two decode steps; requests in flight continue under them and their
  tokens carry the new `policy_version` (= the `step` passed).
- `prompt_logprobs` (engines that support it) scores a token sequence with the weights live between two decode
  steps: the log-prob of each token given the ones before it, under the untempered softmax.
- `start_weight_receiver` (engines that support the broadcast transfer) joins the trainer's weight group in the
  background and applies every version the trainer sends the same way, setting `policy_version` to its step before
  confirming it to the trainer; `receiver_state` says how that is going (for messages).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from primerl.config.inference import BroadcastReceiverSection

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. The server validates values; engines may assume they are sane
    (max_tokens >= 1, temperature >= 0, 0 < top_p <= 1, top_k == -1 or >= 1)."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    stop: list[str] = field(default_factory=list)  # generation ends once the decoded completion contains one
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to eos_token_ids unless ignore_eos
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True  # engines may always compute them; the caller decides what to return


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token."""

    token_id: int
    logprob: float
    policy_version: int


@dataclass(frozen=True)
class Finish:
    """The last event of a request."""

    reason: FinishReason
    policy_versions: tuple[int, int]  # (first, last) policy version among the sampled tokens; (v, v) if none
    prompt_tokens: int
    completion_tokens: int
    stop: str | int | None = None  # the stop string or stop token id that ended the request (reason "stop")


Event = TokenEvent | Finish


class Engine(ABC):
    """A generation engine serving one model. Construct it, `await start()`, then call `generate` concurrently from
    the asyncio loop that started it; `await stop()` when done."""

    model_name: str
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    vocab_size: int = 0  # rows of the model's embedding: often more than the tokenizer has (padded vocabularies)
    policy_version: int = 0
    receiver_state: str = "off"  # the weight broadcast receiver: off, joining ..., rank r of n, failed: ..., closed: ...

    @abstractmethod
    async def start(self) -> None:
        """Load the model and start scheduling. Must be awaited on the loop that will call `generate`."""

    @abstractmethod
    async def stop(self) -> None:
        """Abort every request in flight (each gets `Finish(reason="abort")`) and release the model."""

    @abstractmethod
    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[Event]:
        """Stream `TokenEvent`s for a completion of `prompt_ids`, then exactly one `Finish`.

        Raises ValueError (before yielding) when the prompt is empty or leaves no room under `max_model_len`, and
        RuntimeError when the engine is not running. `request_id` must be unique among requests in flight."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request in flight (no-op for unknown ids); its stream ends with `Finish(reason="abort")`."""

    @abstractmethod
    async def update_weights(self, path: str | Path, step: int) -> None:
        """Load safetensors weights (`model.safetensors` or sharded `*.safetensors` in directory `path`) in place,
        between two decode steps, and set `policy_version = step`. Returns once the new weights are live.
        Raises (and keeps the old weights) if a tensor is missing or has the wrong shape."""

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The log-prob of each token of `token_ids` after the first, given the tokens before it, under the model's
        untempered distribution (softmax of the logits), computed between two decode steps with the weights then
        live: `len(token_ids) - 1` values. Raises RuntimeError when the engine is not running."""
        raise NotImplementedError(f"the {type(self).__name__} engine cannot score prompts")

    async def load_shared_weights(self, snapshot: Path, run_dir: Path, step: int) -> None:
        """Load version `step` from the trainer's shared buffer (primerl.transport.shared) that `snapshot`'s SHARED
        marker points at, between two decode steps, and set `policy_version = step`. Returns once the buffer may be
        overwritten. Raises SharedWeightsError/ValueError (old weights keep serving) when it cannot be used."""
        raise NotImplementedError(f"the {type(self).__name__} engine cannot load shared weights")

    async def start_weight_receiver(self, settings: BroadcastReceiverSection) -> None:
        """Start joining the trainer's weight group (primerl.transport.broadcast) in the background and apply each
        version it sends, between decode steps, until the group closes or the engine stops. Returns at once; a group
        that cannot form is logged and leaves the engine serving (filesystem updates keep working)."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive weight broadcasts")

    @abstractmethod
    async def pause(self) -> None:
        """Stop scheduling decode steps; returns once the step in progress (if any) has finished. Requests wait,
        new ones are queued."""

    @abstractmethod
    async def resume(self) -> None:
        """Continue scheduling after `pause`."""

    @abstractmethod
    def healthy(self) -> bool:
        """True while the engine is started and its scheduler is alive."""


def check_prompt(prompt_ids: list[int], max_model_len: int) -> None:
    """The ValueError `Engine.generate` raises before yielding: an empty prompt, or one that leaves no room for a
    completion under `max_model_len`."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; max_model_len {max_model_len} leaves no room for a completion"
        )
