"""The on-disk batch: packing, dealing rows to ranks, atomic publication, reading at another world size."""

import json

import numpy as np
import pytest

from primerl.transport.checkpoints import prune_batches, published_batches
from primerl.transport.rollouts import (
    Sample,
    batch_dir,
    pack_samples,
    read_batch,
    split_rows,
    wait_for_batch,
    write_batch,
)


def sample(n, adv=1.0, first=10, env="t"):
    ids = list(range(first, first + n))
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return Sample(ids, mask, [-0.5 * m for m in mask], adv, env=env, policy_versions=(3, 4))


def test_pack_keeps_samples_whole_with_restarting_positions():
    samples = [sample(5), sample(7, first=100), sample(3, first=200), sample(6, first=300)]
    packed = pack_samples(samples, seq_len=10)
    a = packed.arrays
    assert a["input_ids"].shape == (3, 10)  # 7+3, 6, 5 (first fit, longest first)
    for i, s in enumerate(samples):
        sel = a["sample_index"] == i
        assert sel.sum() == len(s.input_ids)
        assert a["input_ids"][sel].tolist() == s.input_ids
        assert a["position_ids"][sel].tolist() == list(range(len(s.input_ids)))
        assert a["loss_mask"][sel].tolist() == s.loss_mask
        assert np.allclose(a["inference_logprobs"][sel], s.inference_logprobs)
    pad = a["sample_index"] == -1
    assert pad.sum() == 30 - 21 and a["loss_mask"][pad].sum() == 0
    # padding restarts its own positions after the last sample of a row
    row = int(np.where(pad.any(axis=1))[0][0])
    tail = a["position_ids"][row][pad[row]]
    assert tail.tolist() == list(range(len(tail)))


def test_pack_truncates_long_samples_and_rejects_bad_ones():
    packed = pack_samples([sample(12)], seq_len=8)
    assert packed.num_truncated == 1 and packed.samples[0]["truncated"]
    assert (packed.arrays["sample_index"] == 0).sum() == 8
    with pytest.raises(ValueError, match="loss_mask"):
        Sample([1, 2], [0], [0.0, 0.0], 1.0)
    with pytest.raises(ValueError, match="first token"):
        Sample([1, 2], [1, 1], [0.0, 0.0], 1.0)


def test_per_token_advantages():
    s = Sample([1, 2, 3], [0, 1, 1], [0, -1, -2], [0.0, 0.5, -0.5])
    a = pack_samples([s], 4).arrays
    assert a["advantages"][0].tolist() == [0.0, 0.5, -0.5, 0.0]


def test_split_rows_equal_counts_balanced_tokens():
    samples = [sample(n) for n in (8, 8, 6, 4, 2)]
    arrays = pack_samples(samples, 8).arrays  # 4 rows
    parts = split_rows(arrays, 3)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2]
    total = sum(int(p["loss_mask"].sum()) for p in parts)
    assert total == int(arrays["loss_mask"].sum())
    assert sum(int((p["sample_index"] == -1).all(axis=1).sum()) for p in parts) == 2  # padding rows added


def test_write_read_roundtrip_and_resplit(tmp_path):
    samples = [sample(n, adv=float(n)) for n in (9, 7, 5, 5, 3)]
    path = write_batch(tmp_path, 4, samples, seq_len=12, num_ranks=2, temperature=0.7, extra={"reward": 0.5})
    assert path == batch_dir(tmp_path, 4)
    assert not [p for p in (tmp_path / "rollouts").iterdir() if p.name.startswith(".")]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["num_samples"] == 5 and meta["temperature"] == 0.7 and meta["extra"] == {"reward": 0.5}
    assert meta["num_loss_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert meta["samples"][0]["policy_versions"] == [3, 4]
    two = [read_batch(path, r, 2) for r in range(2)]
    one = read_batch(path, 0, 1)  # a restart at another world size reads all rows
    three = [read_batch(path, r, 3) for r in range(3)]
    for parts in (two, [one], three):
        assert len({p.num_rows for p in parts}) == 1
        ids = np.concatenate([p.arrays["input_ids"][p.arrays["sample_index"] >= 0] for p in parts])
        assert sorted(ids.tolist()) == sorted(t for s in samples for t in s.input_ids)
    with pytest.raises(FileExistsError):
        write_batch(tmp_path, 4, samples, seq_len=12)


def test_wait_for_batch(tmp_path):
    with pytest.raises(TimeoutError):
        wait_for_batch(tmp_path, 0, poll_interval_s=0.01, timeout_s=0.05)
    write_batch(tmp_path, 0, [sample(4)], seq_len=8)
    path, waited = wait_for_batch(tmp_path, 0, timeout_s=1)
    assert path == batch_dir(tmp_path, 0) and waited >= 0


def test_transport_is_torch_free():
    import subprocess
    import sys

    code = "import sys, primerl.transport.rollouts, primerl.transport.snapshots; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shared_prompts_are_laid_out_once_per_row():
    prompt = [11, 12, 13, 14]
    samples = [Sample(prompt + own, [0] * 4 + [1] * len(own), [0.0] * 4 + [-0.5] * len(own), adv)
               for own, adv in (([21, 22], 1.0), ([31], -1.0), ([41, 42, 43], 0.5))]
    samples.append(Sample([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], 2.0))  # a sample of another prompt
    packed = pack_samples(samples, 16, share_prefixes=True)
    a = {k: v[0].tolist() for k, v in packed.arrays.items()}
    assert a["input_ids"][:10] == [11, 12, 13, 14, 21, 22, 31, 41, 42, 43]
    assert a["sample_index"][:10] == [4, 4, 4, 4, 0, 0, 1, 2, 2, 2]  # the prompt segment names no sample
    assert a["parent_index"][:10] == [-1] * 4 + [4] * 6
    assert a["position_ids"][:10] == [0, 1, 2, 3, 4, 5, 4, 4, 5, 6]
    assert a["loss_mask"][:10] == [0] * 4 + [1] * 6
    assert a["advantages"][4:10] == [1.0, 1.0, -1.0, 0.5, 0.5, 0.5]
    assert a["input_ids"][10:13] == [5, 6, 7] and a["parent_index"][10:13] == [-1] * 3
    assert [s["num_tokens"] for s in packed.samples] == [6, 5, 7, 3]  # per sample, as if laid out alone
    # a group too long for one row is split; a part left with one member is laid out whole
    split = pack_samples(samples[:3], 9, share_prefixes=True).arrays
    assert split["sample_index"].tolist() == [[3, 3, 3, 3, 0, 0, 1, -1, -1], [2, 2, 2, 2, 2, 2, 2, -1, -1]]
    assert split["parent_index"].tolist() == [[-1] * 4 + [3] * 3 + [-1] * 2, [-1] * 9]
    assert not pack_samples(samples, 16).arrays["parent_index"].max() >= 0  # off by default


def publish(run, steps):
    for n in steps:
        write_batch(run, n, [sample(5)], seq_len=8)


def test_prune_keeps_what_a_resume_or_the_trainer_still_reads(tmp_path):
    publish(tmp_path, range(10))
    # trained on 0..7; checkpoints at 4 and 6: a resume may read 4 onwards, so 0..3 may go; of those, 1 stays
    assert prune_batches(tmp_path, 1, consumed=8, resumable=[4, 6]) == [0, 1, 2]
    assert published_batches(tmp_path) == [3, 4, 5, 6, 7, 8, 9]
    assert not [p.name for p in (tmp_path / "rollouts").iterdir() if not p.name.startswith("step_")]  # no leftovers
    # a checkpoint newer than what the trainer consumed: the unconsumed batches stay
    assert prune_batches(tmp_path, 0, consumed=5, resumable=[8]) == [3, 4]
    assert published_batches(tmp_path) == [5, 6, 7, 8, 9]
    read_batch(batch_dir(tmp_path, 5))


def test_prune_removes_nothing_without_a_checkpoint_or_a_limit(tmp_path):
    publish(tmp_path, range(6))
    assert prune_batches(tmp_path, 0, consumed=6, resumable=[]) == []  # a resume would start at step 0
    assert prune_batches(tmp_path, None, consumed=6, resumable=[5]) == []
    assert published_batches(tmp_path) == list(range(6))
