"""The real server on the tiny model as a receiver of the trainer's weight group: this test is the sender (trainer
rank 0). A broadcast version is live once the sender's transfer returns; `/admin/update_weights` on its marker
directory confirms it, and the server then samples exactly what the same weights loaded from disk sample."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from server_process import start_server

from primerl.transport import snapshots
from primerl.transport.broadcast import BroadcastSender, WeightTransferError
from primerl.transport.buckets import TensorSpec, plan_buckets

HELLO = [{"role": "user", "content": "Say something."}]


def greedy(client: OpenAI):
    return client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, temperature=0)


def send(sender: BroadcastSender, step: int, tensors: dict[str, torch.Tensor]) -> None:
    manifest = plan_buckets([TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], 256 * 1024)
    sender.begin(step, manifest)
    for index, bucket in enumerate(manifest.buckets):
        sender.send_bucket(index, [tensors[e.name] for e in bucket.tensors])
    sender.end()


def marker_dir(run: Path, step: int) -> Path:
    staged = snapshots.staging_dir(run, step)
    snapshots.write_marker(staged, snapshots.BROADCAST, {"step": step, "transfer_id": f"test-{step}"})
    return snapshots.publish(staged, run, step)


def test_server_applies_a_broadcast_and_samples_like_the_same_weights_from_disk(
    tiny_model_dir: Path, tmp_path: Path, port: int, perturbed_tiny_model
):
    from safetensors.torch import load_file

    tensors = load_file(perturbed_tiny_model(tmp_path / "perturbed") / "model.safetensors")
    run = tmp_path / "run"
    args = ["--weight-transfer", "broadcast", "--weight-broadcast.port", str(port),
            "--weight-broadcast.timeout-s", "30"]
    with start_server(tiny_model_dir, tmp_path / "server", *args) as server:
        client = OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
        admin = server.admin_headers()
        before = greedy(client)
        sender = BroadcastSender("127.0.0.1", port, receivers=1, init_timeout_s=120, timeout_s=30)
        try:
            sender.form()
            send(sender, 1, tensors)  # returns once the server confirmed it applied them
            assert httpx.get(f"{server.base_url}/health").json()["policy_version"] == 1
            confirmed = httpx.post(f"{server.base_url}/admin/update_weights", headers=admin, timeout=60,
                                   json={"path": str(marker_dir(run, 1)), "step": 1})
            assert confirmed.status_code == 200, confirmed.text
            assert confirmed.json() == {"policy_version": 1, "paused": False}
            broadcast = greedy(client)
            assert broadcast.choices[0].model_extra["policy_versions"] == [1]
            assert broadcast.choices[0].message.content != before.choices[0].message.content

            # a marker for a version this server never received is refused, and nothing changes
            unknown = httpx.post(f"{server.base_url}/admin/update_weights", headers=admin, timeout=60,
                                 json={"path": str(marker_dir(run, 5)), "step": 5})
            assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "weights_not_received"

            # the same weights from disk (the filesystem path) sample the same tokens
            from_disk = httpx.post(f"{server.base_url}/admin/update_weights", headers=admin, timeout=60,
                                   json={"path": str(tmp_path / "perturbed"), "step": 2})
            assert from_disk.status_code == 200, from_disk.text
            reloaded = greedy(client)
            assert reloaded.choices[0].model_extra["policy_versions"] == [2]
            assert reloaded.choices[0].message.content == broadcast.choices[0].message.content

            # a manifest that does not fit the model is refused before any byte moves; the old weights serve on
            wrong = dict(tensors)
            name = next(n for n in wrong if n.endswith("q_proj.weight"))
            wrong[name] = wrong[name][:1].clone()
            with pytest.raises(WeightTransferError, match=rf"refused by rank 1: .*{name} has shape"):
                send(sender, 3, wrong)
            assert httpx.get(f"{server.base_url}/health").json()["policy_version"] == 2
        finally:
            sender.close()
        log = server.log()
        assert "joined weight group" in log and "received step 1 by broadcast" in log, log
