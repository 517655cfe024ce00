"""Write the image pipeline's image ids into the recipes' [pins.images] through `primerl recipe lock --image`.

    python ci/pin-images.py FACTS_DIR [RECIPE...]        (default: every recipes/*.toml)

FACTS_DIR holds one JSON file per built image, as the pipeline's build jobs write them:
{"variant": "cuda", "tag": "cuda13", "arch": "arm64", "image_id": "sha256:...", "digest": "sha256:...", "ref": ...}.
A recipe that needs no GPU (`recipe.hardware.gpus_per_node = 0`) pins the `cpu` image, every other recipe the `cuda`
image (primerl:cuda13, the stack of uv.lock, whose versions the recipes' package pins name); primerl:cuda12 is built
from another lock, so no recipe pins it. Prints one line per recipe and architecture; exit 2 on a bad facts file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from primerl.commands.recipe import lock
from primerl.recipes import load_recipe
from primerl.recipes.schema import RecipeError

ROOT = Path(__file__).resolve().parents[1]
PINNED_VARIANTS = ("cpu", "cuda")


def read_facts(facts_dir: Path) -> dict[str, dict[str, str]]:
    """variant -> {arch: image id}, for the variants recipes pin."""
    images: dict[str, dict[str, str]] = {}
    for path in sorted(facts_dir.glob("*.json")):
        facts = json.loads(path.read_text())
        missing = {"variant", "arch", "image_id"} - facts.keys()
        if missing:
            raise ValueError(f"{path}: no {', '.join(sorted(missing))}")
        if facts["variant"] in PINNED_VARIANTS:
            images.setdefault(facts["variant"], {})[facts["arch"]] = facts["image_id"]
    return images


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    facts_dir, recipes = Path(argv[0]), [Path(p) for p in argv[1:]] or sorted((ROOT / "recipes").glob("*.toml"))
    try:
        images = read_facts(facts_dir)
        for path in recipes:
            variant = "cpu" if load_recipe(path).info.hardware.gpus_per_node == 0 else "cuda"
            if images.get(variant):
                lock(path, images=images[variant])
    except (OSError, ValueError, RecipeError) as e:
        print(f"pin-images: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
