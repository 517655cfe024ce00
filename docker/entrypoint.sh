#!/bin/sh
# Entry point of primerl's images.
#
#   docker run primerl:cpu rl recipes/reverse-text.toml   -> rl recipes/...   (a console script of primerl)
#   docker run primerl:cpu check                              -> check            (the validation checklist)
#   docker run primerl:cpu run recipe.toml / models list      -> primerl run ... / primerl models list
#   docker run primerl:cpu python -c '...' / bash             -> the program itself
#   docker run primerl:cpu --help                             -> primerl --help
#
# A first word that names a program on PATH (primerl's aliases rl, sft, eval, check, inference, trainer, orchestrator
# are console scripts in the image's environment) runs that program; any other word is a `primerl` subcommand.
set -e
case "${1:-}" in
    "") exec primerl --help ;;
    -*) exec primerl "$@" ;;
esac
if command -v -- "$1" >/dev/null 2>&1; then
    exec "$@"
fi
exec primerl "$@"
