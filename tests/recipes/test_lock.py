"""`primerl recipe lock` computes pins from this machine and writes them into the recipe file in place; the text
editor underneath keeps comments and everything outside the edited tables."""

from __future__ import annotations

import textwrap

import pytest
from recipe_helpers import TINY_RECIPE, primerl

from primerl.recipes import load_recipe
from primerl.recipes.pins import python_version, verify_pins
from primerl.recipes.tomledit import TomlEditError, replace_tables

UNLOCKED = textwrap.dedent("""\
    # A recipe whose pins are all placeholders.
    [recipe]
    name = "unlocked"
    description = "the tiny recipe before locking"
    stages = ["rl"]

    [recipe.hardware]
    cpu_allowed = true

    # the pins: computed by primerl recipe lock
    [pins]
    python = "3.11"  # the interpreter
    lock_sha256 = "unpinned"  # uv.lock

    [pins.packages]
    torch = "unpinned"

    [pins.model]
    source = "tiny"

    [pins.environment]
    package = "reverse-text"
    version = "unpinned"

    # the stage
    [rl]
    max_steps = 2

    [rl.model]
    name = "tiny"
    """)


def test_lock_fills_every_pin_and_keeps_the_comments(tmp_path):
    path = tmp_path / "unlocked.toml"
    path.write_text(UNLOCKED)
    proc = primerl("recipe", "lock", str(path))
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    for line in UNLOCKED.splitlines():
        if line.startswith(("#", "[")):
            assert line in text, f"lost {line!r}"
    assert 'python = "' + ".".join(python_version().split(".")[:2]) + '"  # the interpreter' in text
    recipe = load_recipe(path)
    assert recipe.pins.model.files.keys() == {"model.safetensors"}
    assert "reverse_text/data/words.txt" in recipe.pins.data
    report = verify_pins(recipe)
    assert report.drifted == [] and report.unpinned == []


def test_lock_is_idempotent_and_check_reports_stale_pins(tmp_path):
    path = tmp_path / "unlocked.toml"
    path.write_text(UNLOCKED)
    assert primerl("recipe", "lock", "--check", str(path)).returncode == 1
    assert path.read_text() == UNLOCKED
    assert primerl("recipe", "lock", str(path)).returncode == 0
    locked = path.read_text()
    proc = primerl("recipe", "lock", "--check", str(path))
    assert proc.returncode == 0 and "pins are current" in proc.stdout
    assert path.read_text() == locked


def test_the_committed_tiny_recipe_is_locked():
    proc = primerl("recipe", "lock", "--check", str(TINY_RECIPE))
    assert proc.returncode == 0, proc.stdout + proc.stderr


DOC = textwrap.dedent("""\
    top = 1
    [a]
    x = "1"  # keep me
    # a comment inside
    gone = "2"
    [a.sub]
    y = "3"
    [b]
    z = [
      1,
    ]
    """)


def test_replace_tables_edits_values_in_place():
    out = replace_tables(DOC, {"a": {"x": "10", "new key": "n"}, "a.sub": {"y": "3"}})
    assert 'x = "10"  # keep me' in out
    assert "# a comment inside" in out
    assert "gone" not in out
    assert out.index('"new key" = "n"') < out.index("[a.sub]")
    assert out.endswith(DOC[DOC.index("[b]"):])


def test_replace_tables_adds_a_new_table_next_to_its_family():
    out = replace_tables(DOC, {"a": {"x": "1"}, "a.sub": {"y": "3"}, "a.more": {"k": "v"}})
    assert out.index("[a.sub]") < out.index("[a.more]") < out.index("[b]")


def test_replace_tables_refuses_what_it_cannot_edit_in_place():
    with pytest.raises(TomlEditError, match=r"\[b\]"):
        replace_tables(DOC, {"b": {"z": "1"}})


def test_lock_with_image_ids_pins_only_the_images(tmp_path):
    """What the image pipeline runs after a build: the image id per architecture goes into [pins.images]; the other
    pins stay as written (they describe the machine the recipe was locked on, not the pipeline's runner)."""
    path = tmp_path / "unlocked.toml"
    path.write_text(UNLOCKED)
    amd64, arm64 = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    proc = primerl("recipe", "lock", str(path), "--image", f"amd64={amd64}", "--image", f"arm64={arm64}")
    assert proc.returncode == 0, proc.stderr
    recipe = load_recipe(path)
    assert recipe.pins.images == {"amd64": amd64, "arm64": arm64}
    assert path.read_text().startswith(UNLOCKED.split("# the stage")[0])
    assert recipe.pins.packages == {"torch": "unpinned"}


def test_lock_with_a_bad_image_id_leaves_the_recipe_as_it_was(tmp_path):
    path = tmp_path / "unlocked.toml"
    path.write_text(UNLOCKED)
    proc = primerl("recipe", "lock", str(path), "--image", "amd64=latest")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and str(path) in proc.stderr and "sha256:<64 hex digits>" in proc.stderr
    assert path.read_text() == UNLOCKED
    assert list(tmp_path.iterdir()) == [path]
