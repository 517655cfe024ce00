"""Recipes: one example = one declarative, pinned run (see `primerl.recipes.schema` for the file format).

`is_recipe(path)` tells a recipe (a TOML file with a top-level `[recipe]` table) from a plain config; the `rl` launcher
hands recipes to `primerl.recipes.run.main`. Importing this package does not import torch.
"""

from primerl.recipes.schema import (
    CAPABILITIES,
    UNPINNED,
    Recipe,
    RecipeError,
    UnsupportedCapabilityError,
    is_recipe,
    load_recipe,
    recipe_in_argv,
)

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
