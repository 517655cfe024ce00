"""Print the build arguments `primerl image build --variant VARIANT` passes, one KEY=VALUE a line, for builders that
do not go through primerl (the image pipeline's buildx): the lock's sha256, primerl's version, the variant's fixed
arguments and, for a variant with a lock of its own, the label pins read from that lock.

    python ci/image-build-args.py cuda12
"""

from __future__ import annotations

import sys
from pathlib import Path

from primerl.launch.images import VARIANTS, context_build_args


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in VARIANTS:
        print(f"usage: image-build-args.py {{{','.join(sorted(VARIANTS))}}}", file=sys.stderr)
        return 2
    for key, value in sorted(context_build_args(Path(__file__).resolve().parents[1], VARIANTS[argv[0]]).items()):
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
