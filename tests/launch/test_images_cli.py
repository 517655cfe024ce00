"""`primerl image` without a daemon: Dockerfile argument parsing, GPU requests, default tags, and the one-line error
when no Docker daemon answers. Building and running images is covered by tests/system."""

from __future__ import annotations

from pathlib import Path

from primerl.commands.image import main
from primerl.launch.images import VARIANTS, dockerfile_args, gpu_requests

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_args_reads_multi_argument_continued_and_quoted_defaults(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "ARG BASE=debian:12\n"
        "FROM ${BASE}\n"
        "# ARG NOT_AN_ARG=1\n"
        'ARG A=1 \\\n    B="two words" \\\n    EMPTY=""\n'
        "ARG BASE\n"
        "ARG NO_DEFAULT\n"
    )
    assert dockerfile_args(dockerfile) == {
        "BASE": "debian:12",
        "A": "1",
        "B": "two words",
        "EMPTY": "",
        "NO_DEFAULT": "",
    }


def test_gpu_requests_follow_the_image_variant_unless_told():
    assert gpu_requests("auto", "cpu") == []
    assert gpu_requests("none", "cuda") == []
    (everything,) = gpu_requests("auto", "cuda")
    assert everything["Count"] == -1 and everything["Capabilities"] == [["gpu"]]
    (two,) = gpu_requests("2", None)
    assert two["Count"] == 2
    (chosen,) = gpu_requests("0,3", "cuda")
    assert chosen["DeviceIDs"] == ["0", "3"]


def test_default_tags_name_the_cuda_major_of_the_base():
    cuda = dockerfile_args(ROOT / VARIANTS["cuda"].dockerfile)["CUDA_VERSION"].split(".")[0]
    assert VARIANTS["cuda"].default_tag(ROOT) == f"primerl:cuda{cuda}"
    assert VARIANTS["cpu"].default_tag(ROOT) == "primerl:cpu"
    assert VARIANTS["cuda12"].default_tag(ROOT) == "primerl:cuda12"
    assert cuda == "13"


def test_unreachable_daemon_is_one_line_and_exit_1(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    assert main(["inspect", "primerl:cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("primerl image: cannot reach a Docker daemon") and "\n" not in err
