"""primerl:cpu, built here with docker-py from a debootstrap base (no registry), then run: the entry point, the pins
its labels claim, torch on CPU without the GPU-only packages, the checklist, and a whole RL recipe writing its run
directory onto a mounted volume. The image is removed at the end (vfs keeps a full copy of every layer)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tomllib

import pytest
from docker_helpers import ROOT, exec_in, remove_image

from primerl.launch.images import VARIANTS, build_image, run_container

# Building the image takes 5-10 minutes on 2 cores with vfs, its tests as long again: beyond the suite-wide 900 s.
pytestmark = [pytest.mark.system, pytest.mark.images, pytest.mark.timeout(2700)]

TINY_RECIPE = "recipes/tiny.toml"
ENTRYPOINT = "/opt/primerl/docker/entrypoint.sh"


def locked_versions() -> dict[str, str]:
    return {p["name"]: p["version"] for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}


@pytest.fixture(scope="module")
def cpu_image(docker_client, base_image, base_python):
    result = build_image(
        docker_client,
        context=ROOT,
        variant=VARIANTS["cpu"],
        tag=f"primerl-test:cpu-{os.getpid()}",
        build_args={"BASE_IMAGE": base_image, "PYTHON_VERSION": base_python},
    )
    yield result
    remove_image(docker_client, result.image_id)


@pytest.fixture(scope="module")
def cpu_container(cpu_image, docker_client):
    """One idle container of the image (no network) that the probes exec into."""
    container = docker_client.containers.run(
        cpu_image.image_id, entrypoint=["sleep", "infinity"], detach=True, network_mode="none"
    )
    yield container
    container.remove(force=True)


def test_build_prints_the_digest_recipes_pin_and_labels_carry_the_pins(cpu_image, docker_client, base_python):
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", cpu_image.image_id)
    assert docker_client.images.get(cpu_image.tags[0]).id == cpu_image.image_id
    labels, versions = cpu_image.labels, locked_versions()
    assert labels["io.primerl.lock-sha256"] == hashlib.sha256((ROOT / "uv.lock").read_bytes()).hexdigest()
    assert labels["io.primerl.python"] == base_python
    for package in ("torch", "transformers", "verifiers"):
        assert labels[f"io.primerl.{package}"] == versions[package]
    assert labels["org.opencontainers.image.version"] == versions["primerl"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", labels["org.opencontainers.image.revision"])


def test_labels_agree_with_what_is_installed_inside(cpu_image, cpu_container):
    code, out = exec_in(cpu_container, ["cat", "image-pins.json"])
    assert code == 0, out
    facts, labels = json.loads(out), cpu_image.labels
    assert facts["lock_sha256"] == labels["io.primerl.lock-sha256"]
    assert facts["python"].startswith(labels["io.primerl.python"] + ".")
    for package in ("torch", "transformers", "verifiers"):
        assert facts["packages"][package] == labels[f"io.primerl.{package}"]


def test_runs_as_an_unprivileged_user(cpu_container):
    code, out = exec_in(cpu_container, ["id", "-u"])
    assert (code, out.strip()) == (0, "1000")


def test_entrypoint_dispatches_primerl_commands_and_programs(cpu_image, docker_client, cpu_container):
    entrypoint = docker_client.images.get(cpu_image.image_id).attrs["Config"]["Entrypoint"]
    assert entrypoint == [ENTRYPOINT]
    code, out = exec_in(cpu_container, [ENTRYPOINT])
    assert code == 0 and "commands:" in out and "rl" in out, out
    code, out = exec_in(cpu_container, [ENTRYPOINT, "inference", "--help"])
    assert code == 0 and "usage: primerl inference" in out, out
    code, out = exec_in(cpu_container, [ENTRYPOINT, "models", "list"])  # not a program: a primerl subcommand
    assert code == 0 and "tiny" in out, out
    code, out = exec_in(cpu_container, [ENTRYPOINT, "python", "-c", "print(6 * 7)"])
    assert (code, out.strip()) == (0, "42")


TORCH_ON_CPU = """
import importlib.util, json, torch
torch.manual_seed(0)
x, w_true = torch.randn(64, 8), torch.randn(8, 1)
y = x @ w_true
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(50):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
q = torch.randn(1, 2, 16, 8)
attn = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
print(json.dumps({
    "cuda_available": torch.cuda.is_available(),
    "first_loss": losses[0], "last_loss": losses[-1],
    "attention_shape": list(attn.shape),
    "skipped_present": [m for m in ("triton", "cuda.bindings") if importlib.util.find_spec(m.split(".")[0])],
}))
"""


def test_torch_trains_on_cpu_without_the_gpu_only_packages(cpu_container):
    code, out = exec_in(cpu_container, ["python", "-c", TORCH_ON_CPU])
    assert code == 0, out
    facts = json.loads(out.strip().splitlines()[-1])
    assert facts["cuda_available"] is False
    assert facts["last_loss"] < facts["first_loss"] / 10
    assert facts["attention_shape"] == [1, 2, 16, 8]
    assert facts["skipped_present"] == []


def test_check_prints_the_checklist_offline(cpu_container):
    """`docker run primerl:cpu check` with no network: the fake-data trainer steps and the inference step run on the
    embedded SmolLM2 baked into the image; steps that need a recipe or a GPU are skipped with their reason."""
    code, out = exec_in(cpu_container, [ENTRYPOINT, "check", "--report", "/tmp/checklist.json"])
    assert code == 0, out[-4000:]
    assert "step" in out and "status" in out, out[-4000:]  # the console table
    code, report = exec_in(cpu_container, ["cat", "/tmp/checklist.json"])
    steps = {s["name"]: (s["status"], s["detail"]) for s in json.loads(report)["steps"]}
    for name in ("python", "torch", "disk", "memory", "ports", "run_dir", "sft_trainer", "rl_trainer", "inference"):
        assert steps[name][0] == "passed", (name, steps[name])
    for name in ("flash_attn", "model", "rl_smoke"):
        assert steps[name][0] == "skipped" and steps[name][1], (name, steps[name])


def test_registry_models_are_baked_in(cpu_container):
    probe = "from primerl.models import resolve_model as r; print(r('smollm2-135m-instruct')); print(r('tiny'))"
    code, out = exec_in(cpu_container, ["python", "-c", probe])
    assert code == 0, out
    assert [line.rsplit("/", 1)[0] for line in out.split()] == ["/opt/primerl/models"] * 2, out


def test_rl_recipe_runs_to_completion_with_its_run_dir_on_a_volume(cpu_image, docker_client, tmp_path):
    output = io.BytesIO()
    code = run_container(
        docker_client,
        cpu_image.image_id,
        ["rl", TINY_RECIPE, "--run-dir", "runs/tiny"],
        run_dir=tmp_path,
        network_mode="none",
        output=output,
    )
    log = output.getvalue().decode(errors="replace")
    assert code == 0, log[-4000:]
    run = tmp_path / "tiny"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest  # the recipe runner wrote its manifest onto the volume
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps and max(s["step"] for s in steps) >= 1, log[-4000:]
