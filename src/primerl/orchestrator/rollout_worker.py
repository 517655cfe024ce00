"""Entry point of an orchestrator's rollout worker process (`primerl.orchestrator.workers` starts it and says what it
does).

SIGINT is ignored before anything else is imported: a Ctrl-C that reaches the whole process group stops the
orchestrator, which then stops its workers; a worker never ends on its own first. Once `main` has closed everything
it opened, the process ends at once (`os._exit`) rather than through the interpreter's shutdown, whose final garbage
collection of the worker's heap (verifiers, pydantic, tokenizers) took over 10 s on a loaded 2-core machine and does
nothing a finished worker needs.
"""

import logging
import os
import signal
import sys

signal.signal(signal.SIGINT, signal.SIG_IGN)

from primerl.orchestrator.workers import main  # after the signal: importing takes seconds

code = main()
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
