"""Check, while an image is being built, that what got installed is what the Dockerfile's labels will claim.

    python check_pins.py --python 3.12 --lock uv.lock [--lock-sha256 HEX] --write pins.json torch=2.13.0 ...

Each NAME=VERSION must equal the installed distribution's version; --python must prefix the running interpreter's
version; a non-empty --lock-sha256 must equal the lock file's sha256. On any mismatch the build stops, listing every
mismatch as `name: label says X, image has Y`. On success the facts are written as JSON (the same facts the labels
carry, read from inside the image) so `docker run IMAGE cat` of that file and `docker inspect` can be compared.
Standard library only: it runs before anything is known to import.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from importlib import metadata
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="expected Python version prefix, e.g. 3.12")
    parser.add_argument("--lock", type=Path, required=True, help="the uv.lock the environment was synced from")
    parser.add_argument("--lock-sha256", default="", help="expected sha256 of the lock (empty: not checked)")
    parser.add_argument("--write", type=Path, required=True, help="where to write the facts as JSON")
    parser.add_argument("pins", nargs="*", metavar="NAME=VERSION")
    args = parser.parse_args(argv)

    python = platform.python_version()
    lock_sha256 = hashlib.sha256(args.lock.read_bytes()).hexdigest()
    problems = []
    if python != args.python and not python.startswith(args.python + "."):
        problems.append(f"python: label says {args.python}, image has {python}")
    if args.lock_sha256 and args.lock_sha256 != lock_sha256:
        problems.append(f"uv.lock sha256: label says {args.lock_sha256}, image has {lock_sha256}")
    packages = {}
    for pin in args.pins:
        name, _, expected = pin.partition("=")
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
        if packages[name] != expected:
            problems.append(f"{name}: label says {expected}, image has {packages[name] or 'nothing installed'}")
    if problems:
        print("the image does not match its pins:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    facts = {"python": python, "machine": platform.machine(), "lock_sha256": lock_sha256, "packages": packages}
    args.write.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    print(json.dumps(facts, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
