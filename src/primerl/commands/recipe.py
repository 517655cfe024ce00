"""`primerl recipe`: tools for recipe files and the manifests of their runs.

    primerl recipe lock RECIPE... [--check] compute the pins from this machine and write them into the recipe file
                                           (comments and everything outside [pins] stay as they are); --check only
                                           reports whether the pins are current (exit 1 if not)
    primerl recipe lock RECIPE... --image ARCH=sha256:ID...
                                           write only these image ids into [pins.images] (what the image pipeline
                                           does after a build; every other pin stays as it is)
    primerl recipe verify RECIPE           compare every pin with this machine (exit 3 on drift)
    primerl recipe diff RUN_A RUN_B        what differs between two runs' manifests, outside their volatile fields
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from primerl.recipes.manifest import manifest_differences, read_manifest
from primerl.recipes.pins import compute_pins, format_checks, stderr_progress, verify_pins
from primerl.recipes.schema import RecipeError
from primerl.recipes.stages import load_recipe
from primerl.recipes.tomledit import TomlEditError, replace_tables


def lock(path: Path, check_only: bool = False, images: dict[str, str] | None = None) -> int:
    recipe = load_recipe(path)
    if images:
        tables, notes = {"pins.images": {**recipe.pins.images, **images}}, []
    else:
        tables, notes = compute_pins(recipe, progress=stderr_progress)
    for note in notes:
        print(f"primerl recipe lock: note: {note}", file=sys.stderr)
    text = path.read_text()
    updated = replace_tables(text, tables)
    if updated == text:
        print(f"{path}: pins are current")
        return 0
    if check_only:
        print(f"{path}: pins are out of date (run `primerl recipe lock {path}`)")
        return 1
    draft = path.with_name(f".{path.name}.lock.toml")  # beside the recipe: its includes resolve the same way
    draft.write_text(updated)
    try:
        load_recipe(draft)  # what is written must still be a valid recipe; the recipe is untouched until it is
        draft.replace(path)
    except RecipeError as e:
        raise RecipeError(str(e).replace(str(draft), str(path))) from None
    finally:
        draft.unlink(missing_ok=True)
    print(f"{path}: pins updated")
    return 0


def _image_pin(item: str) -> tuple[str, str]:
    arch, sep, image_id = item.partition("=")
    if not sep:
        raise RecipeError(f"--image '{item}' is not ARCH=sha256:ID")
    return arch, image_id


def verify(path: Path) -> int:
    from primerl.recipes.plan import DRIFT_EXIT_CODE

    recipe = load_recipe(path)
    report = verify_pins(recipe, progress=stderr_progress)
    print(format_checks(report.checks, verbose=True))
    return DRIFT_EXIT_CODE if report.drifted else 0


def diff(run_a: Path, run_b: Path) -> int:
    differences = manifest_differences(read_manifest(run_a), read_manifest(run_b))
    for line in differences:
        print(line)
    if not differences:
        print("the manifests are equal outside their volatile fields")
    return 1 if differences else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="primerl recipe", description="Recipe tools.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_lock = sub.add_parser("lock", help="compute the pins from this machine and write them into the recipe")
    p_lock.add_argument("recipes", type=Path, nargs="+")
    p_lock.add_argument("--check", action="store_true", help="only report whether the pins are current")
    p_lock.add_argument("--image", action="append", default=[], metavar="ARCH=sha256:ID",
                        help="pin this image id for ARCH (amd64, arm64) and change no other pin; repeatable")
    p_verify = sub.add_parser("verify", help="compare every pin with this machine")
    p_verify.add_argument("recipe", type=Path)
    p_diff = sub.add_parser("diff", help="compare the manifests of two run directories")
    p_diff.add_argument("run_a", type=Path)
    p_diff.add_argument("run_b", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "lock":
            images = dict(_image_pin(item) for item in args.image)
            return max(lock(path, args.check, images) for path in args.recipes)
        if args.cmd == "verify":
            return verify(args.recipe)
        return diff(args.run_a, args.run_b)
    except (RecipeError, TomlEditError) as e:
        print(f"primerl recipe {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"primerl recipe {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
