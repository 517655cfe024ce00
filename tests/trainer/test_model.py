"""The policy on packed rows: log-probs of packed samples equal those computed one by one; the fused chunked head
equals the plain log-softmax in value and gradient."""

import pytest
import torch

from primerl.config.common import ModelConfig
from primerl.config.trainer import LoraConfig, TrainingConfig
from primerl.cpu import cpu_has_bf16_dot_products
from primerl.trainer import logprobs, model
from primerl.trainer.attention import packed_attention_mask
from primerl.trainer.dist import DistInfo
from primerl.trainer.logprobs import bucket_rows, fused_logprobs
from primerl.trainer.model import build_policy
from primerl.transport.rollouts import Sample, pack_samples


def tiny_policy(attention="sdpa", chunk=7, backward_dtype="float32"):
    """float32 backward by default: these tests compare gradients of two layouts at float32 tolerances."""
    train = TrainingConfig(attention=attention, logprob_chunk_tokens=chunk, backward_dtype=backward_dtype)
    policy, _ = build_policy(ModelConfig(name="tiny"), train, LoraConfig(), torch.device("cpu"), DistInfo())
    return policy


def random_samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(torch.randint(3, 1000, (n,), generator=g).tolist(), [0] + [1] * (n - 1), [0.0] * n, 1.0) for n in lengths
    ]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_equal_one_by_one(attention):
    policy = tiny_policy(attention)
    samples = random_samples([5, 17, 9, 30, 2])
    a = {k: torch.from_numpy(v).long() for k, v in pack_samples(samples, 64).arrays.items()}
    assert a["input_ids"].shape[0] == 1  # everything shares one row
    packed = policy(a["input_ids"], a["position_ids"], a["sample_index"], temperature=0.8)
    for i, s in enumerate(samples):
        ids = torch.tensor([s.input_ids])
        alone = policy(ids, torch.arange(ids.shape[1])[None], torch.zeros_like(ids), temperature=0.8)
        sel = a["sample_index"] == i
        torch.testing.assert_close(packed.logprobs[sel], alone.logprobs[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(packed.entropy[sel], alone.entropy[0], atol=2e-5, rtol=1e-5)
        assert packed.logprobs[sel][0] == 0  # a sample's first token has no prediction


def test_logprobs_match_transformers_forward():
    policy = tiny_policy()
    ids = torch.tensor([random_samples([12])[0].input_ids])
    out = policy(ids, torch.arange(12)[None], torch.zeros_like(ids))
    logits = policy.lm(input_ids=ids).logits
    ref = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs[0, 1:], ref, atol=1e-5, rtol=1e-5)


def test_block_diagonal_mask():
    index = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = packed_attention_mask("sdpa", index, torch.float32)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("path", ["kept-probs", "recomputed", "padded-chunks"])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_fused_logprobs_value_and_gradient(chunk, path, monkeypatch):
    if path == "recomputed":  # more rows than forward keeps the probabilities of: backward recomputes the logits
        monkeypatch.setattr(logprobs, "KEEP_PROBS_BYTES", 0)
    if path == "padded-chunks":  # what the GPU path does around its compiled kernels: chunks padded to bucket sizes
        monkeypatch.setattr(logprobs, "_kernel", lambda name, fn, device: lambda *args: fn(*args))
    g = torch.Generator().manual_seed(1)
    h = torch.randn(13, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (13,), generator=g)
    upstream = torch.randn(13, dtype=torch.float64, generator=g)
    lp, ent = fused_logprobs(h, w, y, temperature=0.7, chunk_tokens=chunk)
    (lp * upstream).sum().backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.log_softmax(h @ w.T / 0.7, -1)
    ref_lp = ref.gather(1, y[:, None]).squeeze(1)
    (ref_lp * upstream).sum().backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], w.grad)
    assert not ent.requires_grad


def test_backward_dtype_bfloat16_keeps_forward_and_approximates_the_gradients():
    """A float32 model with bfloat16 backward matmuls: the same log-probs bit for bit (forward is untouched), the
    same state dict, gradients within bfloat16's rounding of the float32 ones; float32 backward changes nothing."""
    samples = group_samples() + random_samples([6, 11])
    a = {k: torch.from_numpy(v).long() for k, v in pack_samples(samples, 64, share_prefixes=True).arrays.items()}
    results = {}
    for dtype in ("float32", "bfloat16"):
        policy = tiny_policy(chunk=5, backward_dtype=dtype)
        out = policy(a["input_ids"], a["position_ids"], a["sample_index"], temperature=0.9,
                     parent_index=a["parent_index"], wanted=a["loss_mask"].bool())
        (out.logprobs * torch.linspace(-1, 1, out.logprobs.numel()).view_as(out.logprobs)).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        swapped = sum(isinstance(m, model.LinearCastingGrads) for m in policy.modules())
        results[dtype] = out.logprobs.detach(), grads, swapped, list(policy.state_dict())
    (lp32, g32, swapped32, keys32), (lp16, g16, swapped16, keys16) = results["float32"], results["bfloat16"]
    assert swapped32 == 0 and swapped16 > 0
    assert keys16 == keys32
    assert torch.equal(lp16, lp32)
    assert g16.keys() == g32.keys()
    for name, grad in g32.items():
        error = (g16[name] - grad).norm() / grad.norm()
        assert 0 < error < 2e-2, (name, error)  # bfloat16 keeps 8 bits: ~0.4 % per product, not exact


def test_backward_dtype_auto_and_bad_choices():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # oneDNN says "supported" on AVX512 without bfloat16 dot products too (software conversion, 4.5x slower than
    # float32 there): auto takes bfloat16 only where the CPU's flags have the instructions
    bf16_cpu = (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and cpu_has_bf16_dot_products() is not False)
    assert model.backward_dtype_for("auto", torch.float32, cpu) == (torch.bfloat16 if bf16_cpu else torch.float32)
    assert model.backward_dtype_for("auto", torch.float32, cuda) == torch.float32
    assert model.backward_dtype_for("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert model.backward_dtype_for("float32", torch.float32, cpu) == torch.float32
    with pytest.raises(ValueError, match="needs a float32 model; its compute dtype is bfloat16"):
        model.backward_dtype_for("float32", torch.bfloat16, cuda)


def test_compiled_head_compiles_a_few_shapes_whatever_the_token_count(monkeypatch):
    """Every step has its own number of loss tokens; the compiled chunk kernels see only bucket sizes."""
    from torch._dynamo.testing import CompileCounter

    counters: dict[str, CompileCounter] = {}

    def counting_kernel(name, fn, device):
        if name not in counters:
            counters[name] = CompileCounter()
            logprobs._compiled[f"count-{name}"] = torch.compile(fn, backend=counters[name], dynamic=False)
        return logprobs._compiled[f"count-{name}"]

    monkeypatch.setattr(logprobs, "_kernel", counting_kernel)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(11, 8, generator=g, requires_grad=True)
    for n in (13, 40, 77, 129, 200, 250, 300, 511):
        h = torch.randn(n, 8, generator=g, requires_grad=True)
        lp, _ = fused_logprobs(h, w, torch.randint(0, 11, (n,), generator=g), chunk_tokens=256)
        lp.sum().backward()
    buckets = {bucket_rows(n - start, 256) for n in (13, 40, 77, 129, 200, 250, 300, 511) for start in (0, 256)
               if start < n}
    assert buckets == {128, 256}
    assert counters["stats"].frame_count == counters["grad"].frame_count == len(buckets)
    torch._dynamo.reset()


def group_samples(prompt_len=7, own=(5, 3, 9, 1), seed=2):
    """Rollouts of one group: the same prompt (loss 0), then completions of their own (loss 1)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 1000, (prompt_len,), generator=g).tolist()
    samples = []
    for k, n in enumerate(own):
        ids = prompt + torch.randint(3, 1000, (n,), generator=g).tolist()
        samples.append(Sample(ids, [0] * prompt_len + [1] * n, [0.0] * len(ids), float(k) - 1.5))
    return samples


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_logprobs_and_gradients_equal_plain_packing(attention):
    """A group laid out as its prompt once plus each completion gives the same log-probs at every loss token, and the
    same gradient of a loss over them, as the group packed sample by sample."""
    samples = group_samples() + random_samples([6])
    results = []
    for share in (False, True):
        policy = tiny_policy(attention)
        a = {k: torch.from_numpy(v).long() for k, v in pack_samples(samples, 64, share_prefixes=share).arrays.items()}
        out = policy(a["input_ids"], a["position_ids"], a["sample_index"], temperature=0.9,
                     parent_index=a["parent_index"], wanted=a["loss_mask"].bool())
        per_sample = [out.logprobs[(a["sample_index"] == i) & (a["loss_mask"] > 0)] for i in range(len(samples))]
        loss = sum((lp * (i + 1)).sum() for i, lp in enumerate(per_sample))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((per_sample, int((a["sample_index"] >= 0).sum()), grads))
    (plain, plain_tokens, plain_grads), (shared, shared_tokens, shared_grads) = results
    for a_lp, b_lp in zip(plain, shared, strict=True):
        torch.testing.assert_close(b_lp, a_lp, atol=2e-5, rtol=1e-5)
    assert shared_tokens == plain_tokens - 3 * 7  # the prompt is laid out once instead of four times
    assert plain_grads.keys() == shared_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prompt_mask_and_predecessors():
    from primerl.trainer.attention import predecessor_positions

    index = torch.tensor([[2, 2, 0, 0, 1, -1]])  # prompt segment 2, then samples 0 and 1 continuing it
    parent = torch.tensor([[-1, -1, 2, 2, 2, -1]])
    mask = packed_attention_mask("sdpa", index, torch.float32, parent)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # sample 1 sees the prompt and itself, not sample 0
        [0, 0, 0, 0, 0, 1],
    ]
    assert predecessor_positions(index, parent).tolist() == [[-1, 0, 1, 2, 1, -1]]
    with pytest.raises(ValueError, match="shared prompts"):
        packed_attention_mask("flash_attention_2", index, torch.float32, parent)


def test_only_wanted_tokens_pay_for_the_head():
    policy = tiny_policy()
    ids = torch.tensor([random_samples([12])[0].input_ids])
    wanted = torch.zeros_like(ids, dtype=torch.bool)
    wanted[0, 5:9] = True
    full = policy(ids, torch.arange(12)[None], torch.zeros_like(ids))
    part = policy(ids, torch.arange(12)[None], torch.zeros_like(ids), wanted=wanted)
    torch.testing.assert_close(part.logprobs[wanted], full.logprobs[wanted])
    assert not part.logprobs[~wanted].any()


def test_compiled_layers_with_bfloat16_backward_match_the_uncompiled_ones(inductor_cpu):
    """`train.compile` with the bfloat16 backward (the CPU's `auto` choice): the compiled decoder layers give the
    uncompiled layers' log-probs and, within rounding, their gradients. Skipped where inductor cannot build CPU
    code."""
    samples = group_samples() + random_samples([6, 11])
    a = {k: torch.from_numpy(v).long() for k, v in pack_samples(samples, 64, share_prefixes=True).arrays.items()}
    results = {}
    for compile in (False, True):
        train = TrainingConfig(attention="sdpa", logprob_chunk_tokens=5, backward_dtype="bfloat16", compile=compile)
        policy, _ = build_policy(ModelConfig(name="tiny"), train, LoraConfig(), torch.device("cpu"), DistInfo())
        out = policy(a["input_ids"], a["position_ids"], a["sample_index"], temperature=0.9,
                     parent_index=a["parent_index"], wanted=a["loss_mask"].bool())
        (out.logprobs * torch.linspace(-1, 1, out.logprobs.numel()).view_as(out.logprobs)).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results[compile] = out.logprobs.detach(), grads
    (eager_lp, eager_grads), (compiled_lp, compiled_grads) = results[False], results[True]
    torch.testing.assert_close(compiled_lp, eager_lp, atol=2e-5, rtol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        error = (compiled_grads[name] - grad).norm() / grad.norm()
        assert error < 2e-3, (name, error)  # the same bfloat16 products; fusion rounds a few sums differently


def test_the_head_sees_a_multiple_of_width_multiple_tokens_and_the_same_results(monkeypatch):
    """`train.width_multiple`: the head's token count is rounded up (few shapes for a CPU backend's kernel cache); the
    log-probs, entropies and gradients are those of the unrounded head."""
    seen = []
    real = model.fused_logprobs

    def recording(hidden, *args):
        seen.append(hidden.shape[0])
        return real(hidden, *args)

    monkeypatch.setattr(model, "fused_logprobs", recording)
    samples = random_samples([5, 17, 9])
    a = {k: torch.from_numpy(v).long() for k, v in pack_samples(samples, 64).arrays.items()}
    results = []
    for multiple in (1, 16):
        policy = tiny_policy()
        policy.width_multiple = multiple
        out = policy(a["input_ids"], a["position_ids"], a["sample_index"], wanted=a["loss_mask"].bool())
        (out.logprobs * torch.arange(64)).sum().backward()
        results.append((out, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    assert seen == [28, 32]  # 4 + 16 + 8 loss tokens; rounded up to 32
    (plain, plain_grads), (rounded, rounded_grads) = results
    torch.testing.assert_close(rounded.logprobs, plain.logprobs)
    torch.testing.assert_close(rounded.entropy, plain.entropy)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(rounded_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
