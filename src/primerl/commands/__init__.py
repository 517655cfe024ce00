"""Command lines above the libraries they drive: `check` (`primerl check`). Each module exposes `main(argv) -> int`
and is dispatched by `primerl.cli`; nothing below this package imports it.
"""
