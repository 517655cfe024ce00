"""A compact forward for Llama-family models (Llama, Qwen2, Qwen3) with a static KV cache, for fast batched decode.

It reads the Hugging Face model's own parameters (q/k/v and gate/up fused into one matmul each, the HF parameters
re-pointed at slices of the fused tensors, so in-place weight updates apply at once) and computes what the
HF forward computes: RMSNorm in float32, rotary embeddings from the model's `inv_freq`, grouped-query attention
through torch SDPA with a per-row length mask, SwiGLU, optional q/k norms (Qwen3) and projection biases (Qwen2).

The KV cache is one tensor per layer, [rows, kv_heads, capacity, head_dim]; capacity doubles (up to max_len) as
sequences grow. A decode step attends to the first `span` positions of rows 0..n-1, `span` a power of two that
covers the longest row, so its shapes are static per (row bucket, span): on CUDA each such shape is captured once
as a CUDA graph and replayed, which removes the per-kernel launch cost that bounds small-batch decode.

With `compile`, one decoder layer of the decode step goes through torch.compile once and serves every layer (their
weights are its arguments; the row count, span and cache capacity are marked dynamic, every other size is static),
before the step is captured: the norms, rotary embedding, attention softmax, SwiGLU and residual adds of a layer fuse
into a few kernels, where the eager step launches ~45 small kernels per layer, each near the GPU's launch floor even
inside a graph. Compiling one layer, not the 30-layer step, keeps the compile to seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from primerl.inference.engines.decoders import Decoder
from primerl.inference.engines.llama_ops import (
    _bucket,
    _compiled,
    _compiled_sampler,
    _decode_attention,
    _fuse,
    _linear,
    _onednn_prepacks,
    _Projection,
    _rms_norm,
    _rotary_tables,
    _rotate,
    _sdpa_decode_attention,
)
from primerl.inference.engines.sampling import sample_unfiltered

_SUPPORTED_TYPES = {"llama", "qwen2", "qwen3"}
_MIN_SPAN = 128


def cache_capacity(length: int, max_len: int, current: int = 0) -> int:
    """The positions per row the KV cache grows to for a row of `length` positions (the spare one not counted): from
    `current` (at least 2 x _MIN_SPAN) doubling until it covers the row, at most max_len. The checklist's memory
    estimate sizes the cache with it too."""
    capacity = max(current, _MIN_SPAN * 2)
    while capacity < length:
        capacity *= 2
    return min(capacity, max_len)


class LlamaDecoder(Decoder):
    """Static-KV-cache decoder over a Llama-family HF model; see the module docstring."""

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        config = model.config
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        return (
            config.model_type in _SUPPORTED_TYPES
            and config.hidden_act == "silu"
            and rope_type != "dynamic"
            and not getattr(config, "use_sliding_window", False)
            and not getattr(config, "mlp_bias", False)
        )

    def __init__(
        self, model: PreTrainedModel, max_rows: int, max_len: int, cuda_graphs: bool = False, compile: bool = False
    ):
        config = model.config
        self.model = model
        self.max_rows = max_rows
        self.max_len = max_len
        self.layers = list(model.model.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.device = model.device
        self.dtype = model.dtype
        # q/k/v and gate/up each become one matmul: the HF parameters are re-pointed at slices of the fused
        # tensors, so the model is unchanged for every other user and in-place weight updates reach both.
        # inductor lowers a float32 packed matmul only where the weight is a constant of the graph (frozen), never an
        # argument as here: the compiled float32 layer multiplies the plain weights
        prepack = (self.device.type == "cpu" and _onednn_prepacks(model.dtype)
                   and not (compile and model.dtype == torch.float32))
        self.projections = [
            {
                "qkv": _Projection(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), prepack),
                "o": _Projection(attn.o_proj.weight, attn.o_proj.bias, prepack),
                "gate_up": _Projection(_fuse([mlp.gate_proj, mlp.up_proj])[0], None, prepack),
                "down": _Projection(mlp.down_proj.weight, None, prepack),
            }
            for attn, mlp in ((layer.self_attn, layer.mlp) for layer in self.layers)
        ]
        self.lm_head = _Projection(model.lm_head.weight, None, prepack)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.cos, self.sin = _rotary_tables(model.model.rotary_emb, max_len, self.device, self.dtype)
        self.capacity = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        # compiled: no bucket of one row, which torch.compile would specialise on (a second compile)
        smallest = 2 if compile and max_rows > 1 else 1
        self.row_buckets = sorted(
            {*(2**i for i in range(4) if smallest <= 2**i < max_rows), *range(8, max_rows, 8), max_rows}
        )
        self.prepack = prepack
        self.eps = self.layers[0].input_layernorm.variance_epsilon
        self.layer_operands = self._layer_operands()
        self.compiled = compile
        # one decoder layer is compiled once and serves every layer (their weights are its arguments)
        self._decode_layer = _compiled(self._layer) if compile else self._layer
        # the sampling in the CUDA graphs too: compiled, its ~40 kernels over the vocabulary become ~6 (P3: 110 ->
        # 24 us a step for SmolLM2's 49k tokens, benchmarks/NOTES.md section 11); the CPU keeps the eager kernels
        self._sample = _compiled_sampler(sample_unfiltered) if compile and self.device.type == "cuda" else sample_unfiltered
        self._followed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # decode_many(follow=True)
        self.window = torch.arange(max_len, device=self.device)  # window[:span]: the positions a decode step sees
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.sampling_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if self.cuda_graphs:
            self.graph_pool = torch.cuda.graph_pool_handle()
            self.static_tokens = torch.zeros(max_rows, dtype=torch.long, device=self.device)
            self.static_positions = torch.zeros(max_rows, dtype=torch.long, device=self.device)
            self.static_logits = torch.zeros(max_rows, config.vocab_size, device=self.device)
            self.static_temperature = torch.ones(max_rows, device=self.device)
            self.static_uniform = torch.full((max_rows,), 0.5, dtype=torch.float64, device=self.device)
            self.static_logprobs = torch.zeros(max_rows, device=self.device)

    # ---------------------------------------------------------------------------------------------- the cache

    def _reserve(self, length: int) -> None:
        """Grow the cache to hold `length` positions per row (capacity doubles; captured graphs are dropped)."""
        if length <= self.capacity:
            return
        capacity = cache_capacity(length, self.max_len, self.capacity)
        # one spare position, never attended to: a decode step's slice of the cache is then never one contiguous
        # block, which the compiled attention products would read differently (a second compile)
        shape = (self.max_rows, self.num_kv_heads, capacity + 1, self.head_dim)

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old is not None:
                new[:, :, : self.capacity] = old[:, :, : self.capacity]
            return new

        self.k_cache = [grown(old) for old in self.k_cache or [None] * len(self.layers)]
        self.v_cache = [grown(old) for old in self.v_cache or [None] * len(self.layers)]
        if self.compiled:  # one compiled layer serves every capacity
            for cache in (*self.k_cache, *self.v_cache):
                torch._dynamo.maybe_mark_dynamic(cache, 2)
        self.capacity = capacity
        self.graphs.clear()
        self.sampling_graphs.clear()
        if self.cuda_graphs:
            # a fresh pool for the graphs captured from now on: the dropped graphs released the old one, and torch
            # refuses a capture into a released pool while a block from it is still alive (an internal assert in
            # the caching allocator), which is what a row growing past the first capacity met
            self.graph_pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()
    def weights_changed(self) -> None:
        self.layer_operands = []  # the old packings' last references: each is freed before its re-pack
        for projection in (self.lm_head, *(p for layer in self.projections for p in layer.values())):
            projection.refresh()
        self.layer_operands = self._layer_operands()

    def _layer_operands(self) -> list[tuple[torch.Tensor | None, ...]]:
        """Per layer, the tensors `_layer` computes with: (input norm, qkv, qkv bias, q norm, k norm, o, o bias,
        post-attention norm, gate_up, down); the q/k norms are None where the model has none."""
        operands = []
        for layer, project in zip(self.layers, self.projections, strict=True):
            attn = layer.self_attn
            operands.append((
                layer.input_layernorm.weight, project["qkv"].operand, project["qkv"].bias,
                attn.q_norm.weight if self.qk_norm else None, attn.k_norm.weight if self.qk_norm else None,
                project["o"].operand, project["o"].bias, layer.post_attention_layernorm.weight,
                project["gate_up"].operand, project["down"].operand,
            ))
        return operands

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the decode layer (with `compile`; a no-op otherwise) and, on CUDA, capture the smallest shape of
        both graphs, by decoding token 0 at position 0 in two rows that prefill overwrites before they are used."""
        if not self.compiled:
            return
        rows = min(2, self.max_rows)
        self.decode([0] * rows, [0] * rows)
        self.decode_many([0] * rows, [0] * rows, torch.ones(rows), torch.full((1, rows), 0.5, dtype=torch.float64))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, length: int) -> None:
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst, :, :length] = cache[src, :, :length]

    # ----------------------------------------------------------------------------------------------- forward

    def _layer(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, operands: tuple, attend, *state: torch.Tensor
    ) -> torch.Tensor:
        """One decoder layer over x [B, T, hidden]. `attend(q, k, v, *state)` stores k/v [B, kv_heads, T, head_dim]
        and returns the attention output [B, heads, T, head_dim]."""
        in_norm, qkv, qkv_bias, q_norm, k_norm, o, o_bias, post_norm, gate_up, down = operands
        batch, length, _ = x.shape
        h = _rms_norm(x, self.eps, in_norm)
        q, k, v = _linear(h, qkv, qkv_bias, self.prepack).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(batch, length, -1, self.head_dim)
        k = k.view(batch, length, -1, self.head_dim)
        v = v.view(batch, length, -1, self.head_dim)
        if q_norm is not None:
            q, k = _rms_norm(q, self.eps, q_norm), _rms_norm(k, self.eps, k_norm)
        q = _rotate(q.transpose(1, 2), cos, sin)
        k = _rotate(k.transpose(1, 2), cos, sin)
        out = attend(q, k, v.transpose(1, 2), *state)
        x = x + _linear(out.transpose(1, 2).reshape(batch, length, -1), o, o_bias, self.prepack)
        gate, up = _linear(_rms_norm(x, self.eps, post_norm), gate_up, None, self.prepack).chunk(2, dim=-1)
        return x + _linear(F.silu(gate) * up, down, None, self.prepack)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend, *shared, decoding=False):
        """Hidden states after the final norm for input_ids [B, T] at positions [B, T]; each layer attends with
        `attend(q, k, v, its k cache, its v cache, *shared)`. `decoding` (T = 1) runs the decode layer, compiled
        with `compile`, whose varying sizes are marked here."""
        layer = self._decode_layer if decoding else self._layer
        x = F.embedding(input_ids, self.model.model.embed_tokens.weight)
        cos = self.cos[positions][:, None]  # [B, 1, T, head_dim]
        sin = self.sin[positions][:, None]
        mark = decoding and self.compiled
        if mark:
            for tensor in (cos, sin, *shared):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(shared[-1], 3)  # the span of the visibility mask
        for operands, k_cache, v_cache in zip(self.layer_operands, self.k_cache, self.v_cache, strict=True):
            if mark:
                torch._dynamo.maybe_mark_dynamic(x, 0)
            x = layer(x, cos, sin, operands, attend, k_cache, v_cache, *shared)
        return _rms_norm(x, self.eps, self.model.model.norm.weight)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------------------------------------ prefill

    @torch.inference_mode()
    def prefill(self, first_row: int, prompts: list[list[int]]) -> torch.Tensor:
        """Each distinct prompt runs through the model once; rows that share a prompt (the completions of one
        group) get copies of its keys and values and of its last logits."""
        distinct: dict[tuple[int, ...], int] = {}
        copy_of = [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts]
        unique = [list(prompt) for prompt in distinct]
        width = max(len(p) for p in unique)
        self._reserve(width)
        input_ids = torch.zeros(len(unique), width, dtype=torch.long)
        for i, prompt in enumerate(unique):
            input_ids[i, : len(prompt)] = torch.tensor(prompt)
        input_ids = input_ids.to(self.device)
        positions = torch.arange(width, device=self.device).expand(len(unique), width)
        rows = torch.arange(first_row, first_row + len(prompts), device=self.device)
        source = torch.tensor(copy_of, device=self.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
            k_cache[rows, :, :width] = k[source]
            v_cache[rows, :, :width] = v[source]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        hidden = self._forward(input_ids, positions, attend)
        last = torch.tensor([len(p) - 1 for p in unique], device=self.device)
        return self._logits(hidden[torch.arange(len(unique), device=self.device), last])[source]

    # ------------------------------------------------------------------------------------------------- decode

    def _decode_forward(self, tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        """One token per row for rows 0..len(tokens)-1, attending to positions < min(position + 1, span)."""
        rows = tokens.shape[0]
        visible = (self.window[:span][None, :] <= positions[:, None])[:, None, None, :]
        # where each row's new keys and values go: (row, kv head, its position), indices broadcast to [rows, kv_heads]
        where = (
            torch.arange(rows, device=self.device)[:, None],
            torch.arange(self.num_kv_heads, device=self.device)[None, :],
            positions[:, None],
        )
        hidden = self._forward(tokens[:, None], positions[:, None], self._decode_attend, *where, visible, decoding=True)
        return self._logits(hidden[:, 0])

    def _decode_attend(self, q, k, v, k_cache, v_cache, row, head, position, visible) -> torch.Tensor:
        # index_put_ on the cache itself: torch.compile writes it in place. The same write through a view of the
        # cache (view(-1, head_dim).index_copy_) compiles, on torch 2.10-2.11, to a copy of the whole cache per layer
        # and step: half of the compiled step's time on an H200 (benchmarks/NOTES.md, section 9)
        rows, span = q.shape[0], visible.shape[-1]
        k_cache.index_put_((row, head, position), k[:, :, 0])
        v_cache.index_put_((row, head, position), v[:, :, 0])
        attention = _sdpa_decode_attention if q.is_cuda else _decode_attention
        return attention(q, k_cache[:rows, :, :span], v_cache[:rows, :, :span], visible)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        span = self._span(max(positions) + 1)
        if not self.cuda_graphs:
            token_tensor = torch.tensor(tokens, device=self.device)
            position_tensor = torch.tensor(positions, device=self.device)
            return self._decode_forward(token_tensor, position_tensor, span)
        rows = self._load_static_inputs(tokens, positions)
        graph = self.graphs.get((rows, span)) or self._capture(rows, span)
        graph.replay()
        return self.static_logits[: len(tokens)]

    def _span(self, longest: int) -> int:
        """Reserve the cache for `longest` positions; the attention span (a power of two) that covers them."""
        self._reserve(longest)
        return min(_bucket(longest, [_MIN_SPAN * 2**i for i in range(32)]), self.capacity)

    def _load_static_inputs(self, tokens: list[int], positions: list[int]) -> int:
        """Copy rows' tokens and positions into the graphs' static inputs (one host-to-device copy); returns the
        row bucket the graph runs (rows past len(tokens) decode token 0 at position 0, and nobody reads them)."""
        n = len(tokens)
        rows = _bucket(n, self.row_buckets)
        host = torch.zeros(2, rows, dtype=torch.long)
        host[0, :n] = torch.tensor(tokens)
        host[1, :n] = torch.tensor(positions)
        self.static_tokens[:rows].copy_(host[0], non_blocking=True)
        self.static_positions[:rows].copy_(host[1], non_blocking=True)
        return rows

    @torch.inference_mode()
    def decode_many(
        self,
        tokens: list[int] | None,
        positions: list[int],
        temperature: torch.Tensor | None,
        uniforms: torch.Tensor,
        follow: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        steps, n = uniforms.shape
        span = self._span(max(positions) + steps)
        out_tokens = torch.empty(steps, n, dtype=torch.long, device=self.device)
        out_logprobs = torch.empty(steps, n, device=self.device)
        uniforms = uniforms.to(self.device, non_blocking=True)
        if not self.cuda_graphs:
            if follow:
                token_tensor, position_tensor, temperature = self._followed
            else:
                token_tensor = torch.tensor(tokens, device=self.device)
                position_tensor = torch.tensor(positions, device=self.device)
                temperature = temperature.to(self.device)
            for step in range(steps):
                logits = self._decode_forward(token_tensor, position_tensor, span)
                token_tensor, logprobs = self._sample(logits, temperature, uniforms[step])
                out_tokens[step], out_logprobs[step] = token_tensor, logprobs
                position_tensor = position_tensor + 1
            self._followed = token_tensor, position_tensor, temperature
            return out_tokens, out_logprobs
        if follow:  # the static inputs already hold the last sampled tokens and the positions after them
            rows = _bucket(n, self.row_buckets)
        else:
            rows = self._load_static_inputs(tokens, positions)
            self.static_temperature[:n].copy_(temperature, non_blocking=True)
            self.static_temperature[n:rows].fill_(1.0)
        graph = self.sampling_graphs.get((rows, span)) or self._capture(rows, span, sampling=True)
        for step in range(steps):
            self.static_uniform[:n].copy_(uniforms[step])
            graph.replay()  # decode, sample, feed the sampled token back, advance the positions
            out_tokens[step].copy_(self.static_tokens[:n])
            out_logprobs[step].copy_(self.static_logprobs[:n])
        return out_tokens, out_logprobs

    def _sampling_step(self, rows: int, span: int) -> None:
        """One decode step of rows 0..rows-1 with sampling, reading and writing only static buffers (capturable)."""
        tokens, positions = self.static_tokens[:rows], self.static_positions[:rows]
        logits = self._decode_forward(tokens, positions, span)
        temperature, uniform = self.static_temperature[:rows], self.static_uniform[:rows]
        if self._sample is not sample_unfiltered:  # compiled: one program for every row count
            for tensor in (logits, temperature, uniform):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        sampled, logprobs = self._sample(logits, temperature, uniform)
        self.static_logprobs[:rows].copy_(logprobs)
        tokens.copy_(sampled)
        positions.add_(1)

    def _capture(self, rows: int, span: int, sampling: bool = False) -> torch.cuda.CUDAGraph:
        """Capture the decode step for `rows` rows and attention span `span`. Padding rows (beyond the rows in use)
        decode token 0 at position 0 into rows nobody reads; prefill overwrites them before they are used."""
        tokens, positions, logits = self.static_tokens[:rows], self.static_positions[:rows], self.static_logits[:rows]

        def step() -> None:
            if sampling:
                self._sampling_step(rows, span)
            else:
                logits.copy_(self._decode_forward(tokens, positions, span))

        saved = tokens.clone(), positions.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(2):
                step()
                tokens.copy_(saved[0])
                positions.copy_(saved[1])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            step()
        tokens.copy_(saved[0])  # capturing recorded the step without running it; inputs stay as they were
        positions.copy_(saved[1])
        (self.sampling_graphs if sampling else self.graphs)[(rows, span)] = graph
        return graph
