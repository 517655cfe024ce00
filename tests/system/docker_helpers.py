"""Helpers of the system tests that use Docker (fixtures are in conftest.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "ci"


def run_in_image(client, image: str, command: list[str], **kwargs) -> tuple[int, str]:
    """Run `command` in a fresh container of `image` (no network unless asked); its exit status and output."""
    kwargs.setdefault("network_mode", "none")
    container = client.containers.run(image, command, detach=True, **kwargs)
    try:
        code = int(container.wait()["StatusCode"])
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def remove_image(client, image_id: str) -> None:
    """Remove an image this test built, with the untagged intermediate layers under it."""
    client.images.remove(image_id, force=True)


def exec_in(container, command: list[str]) -> tuple[int, str]:
    """Run `command` in a running container (as the image's user); its exit status and output. With vfs every new
    container copies the whole image, so tests probe one long-lived container rather than starting one per probe."""
    code, out = container.exec_run(command)
    return int(code), out.decode(errors="replace")
