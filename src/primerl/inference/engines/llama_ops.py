"""The building blocks of the fast Llama decoder (primerl.inference.engines.llama): fused projections (pre-packed for
oneDNN on the CPU), decode attention, torch.compile wrappers and bucket sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primerl.cpu import onednn_bf16


def _onednn_prepacks(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies by pre-laid-out weights in `dtype` on this CPU (float32 always, where oneDNN is
    built in; bfloat16 where the CPU has bfloat16 dot products)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16())


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dimension and make each module's
    parameters views into the result. Returns (weight, bias or None)."""
    fused = []
    for attribute in ("weight", "bias"):
        parts = [getattr(linear, attribute) for linear in linears]
        if parts[0] is None:
            fused.append(None)
            continue
        whole = torch.cat([p.data for p in parts])
        offset = 0
        for part in parts:
            part.data = whole[offset : offset + part.shape[0]]
            offset += part.shape[0]
        fused.append(whole)
    return fused[0], fused[1]


class _Projection:
    """One matmul of the forward, x @ weight.T (+ bias). With `prepack` (on CPU) it multiplies by a copy of the weight
    laid out once for oneDNN, which saves the re-layout every call otherwise pays (at 16 rows on one core: float32
    1.3-2x faster than `F.linear`, bfloat16 2-4x; benchmarks/NOTES.md); `refresh()` re-packs after the weight
    changed in place."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool):
        self.weight, self.bias, self.prepack = weight, bias, prepack
        self.packed: torch.Tensor | None = None
        self.refresh()

    def refresh(self) -> None:
        """Re-pack the weight. The old packing is freed first, so the new one (the same size) takes its place in the
        heap: a server keeps every block it frees (`primerl.cpu.keep_freed_memory`), and a new packing made while the
        old one lived went elsewhere each version, around the blocks allocated in between, and the heap's free space
        grew with the versions (benchmarks/NOTES.md, "The long-run soak", section 9). The caller holds no other
        reference to the old packing (`LlamaDecoder.weights_changed`)."""
        if self.prepack:
            self.packed = None
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)

    @property
    def operand(self) -> torch.Tensor:
        """What `_linear` multiplies by: the packed copy where there is one, else the weight."""
        return self.weight if self.packed is None else self.packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.operand, self.bias, self.prepack)


EXACT_PACKED_ROWS = 16  # up to this many rows (a decode step's), a packed matmul runs at its own row count


def packed_rows(rows: int) -> int:
    """The row count a packed matmul of `rows` rows runs at: `rows` itself up to `EXACT_PACKED_ROWS`, else the next of
    24, 32, 48, 64, 96, 128, ... (two sizes per doubling: at most 1.5x the rows). oneDNN compiles and keeps kernels
    for every input shape it meets (about 0.5 MB each, up to 1,024 of them per cache), and a prefill's rows (prompts
    x the longest prompt) take almost every value: without the rounding the CPU server's memory grew with each new
    prompt length, by hundreds of MB over a long run (benchmarks/NOTES.md, "The long-run soak")."""
    if rows <= EXACT_PACKED_ROWS:
        return rows
    size = EXACT_PACKED_ROWS
    while size < rows:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def _linear(x: torch.Tensor, operand: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    if not packed:
        return F.linear(x, operand, bias)
    if torch.compiler.is_compiling():  # the compiled decode step: its shapes are the row buckets already
        return torch.ops.mkldnn._linear_pointwise(x, operand, bias, "none", [], "")
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])  # one row count, one kernel: [2, 48, d] and [1, 96, d] share it
    padded = packed_rows(rows)
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, x.shape[-1])])
    out = torch.ops.mkldnn._linear_pointwise(flat, operand, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def _rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm computed in float32, as the HF Llama forward does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotary_tables(rotary, max_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] of the model's rotary embedding (`inv_freq`, `attention_scaling`)."""
    positions = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * rotary.inv_freq.to(device, torch.float32)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * rotary.attention_scaling).to(dtype), (angles.sin() * rotary.attention_scaling).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., head_dim] at the given cos/sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Attention of one query per row, q [B, heads, 1, D], over keys/values [B, kv_heads, S, D] where `visible`
    [B, 1, 1, S]; heads h*g..h*g+g-1 share kv head h (grouped-query), without repeating the keys and values. The
    scores and softmax are float32, the products in the model's dtype (as SDPA does)."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * dim**-0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, heads, 1, dim)


def _sdpa_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """`_decode_attention` through torch SDPA: on CUDA one fused kernel (cuDNN's) where the grouped products are
    three, 5-12 % of a compiled decode step on an H200 (benchmarks/NOTES.md, section 9); on the CPU the grouped
    products are the faster (SDPA's CPU kernel repeats the keys per query head)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)


def _compiled(function):
    """torch.compile `function`, whose inputs' dynamic dimensions the caller marks (`torch._dynamo.mark_dynamic`);
    every other size is static. Duck sizing is off while it compiles: sizes equal at the first call (a span and the
    cache's capacity) would otherwise be assumed equal, and the first call where they differ would compile again."""
    import torch.fx.experimental._config as fx_config

    compiled = torch.compile(function, dynamic=False, fullgraph=True)

    def call(*args):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args)

    return call


def _compiled_sampler(function):
    """The sampler as the CUDA decoder runs it with `compile` (benchmarks/engine.py's baseline replaces this)."""
    return _compiled(function)


def _bucket(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)
