"""Recipes: one example = one declarative, pinned run (see `primerl.recipes.schema` for the file format).

The data side of a recipe: its schema, its pins (`pins`), the plan of a run (`plan`) and the manifest it leaves in the
run directory (`manifest`). The commands that run recipes are in `primerl.commands` (`run`, `recipe`, `rl`).
`is_recipe(path)` tells a recipe (a TOML file with a top-level `[recipe]` table) from a plain config. Importing this
package does not import torch.
"""

from primerl.recipes.schema import (
    CAPABILITIES,
    UNPINNED,
    Recipe,
    RecipeError,
    UnsupportedCapabilityError,
    is_recipe,
    recipe_in_argv,
)
from primerl.recipes.stages import load_recipe

__all__ = [
    "CAPABILITIES",
    "UNPINNED",
    "Recipe",
    "RecipeError",
    "UnsupportedCapabilityError",
    "is_recipe",
    "load_recipe",
    "recipe_in_argv",
]
