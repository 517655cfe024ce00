"""Command lines above the libraries they drive: `rl` (`rl`: a recipe or a plain RL config), `run` (`primerl run`:
pins, checklist, stages), `recipe` (`primerl recipe`: lock, verify, diff) and `check` (`primerl check`). Each module
exposes `main(argv) -> int` and is dispatched by `primerl.cli`; nothing below this package imports it.
"""
