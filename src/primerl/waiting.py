"""A line every few seconds through a long, silent wait (`Waiting`), so that loading or converting a model never
looks like a hang. A base module: the model registry uses it as well as the commands.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Self


class Waiting:
    """`with Waiting("loading the model"):` prints "<prog>: still loading the model (12 s)" every `every_s` seconds
    until the block ends, so a long silence says what it waits for. Nothing is printed when the block ends sooner."""

    def __init__(self, what: str, prog: str = "primerl", every_s: float = 5.0, stream=None):
        self.what, self.prog, self.every_s = what, prog, every_s
        self.stream = stream if stream is not None else sys.stderr
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        started = time.monotonic()

        def beat() -> None:
            while not self._done.wait(self.every_s):
                print(f"{self.prog}: still {self.what} ({time.monotonic() - started:.0f} s)", file=self.stream,
                      flush=True)

        self._thread = threading.Thread(target=beat, name="waiting", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
