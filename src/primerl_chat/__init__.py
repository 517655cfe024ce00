"""The harness id `primerl-chat`: primerl's in-process chat loop (`primerl.orchestrator.envkit.ChatHarness`).

verifiers resolves a harness id by importing the top-level module of that name and taking the one `vf.Harness`
subclass its `__all__` exports; this module is that entry for primerl's harness.
"""

from primerl.orchestrator.envkit import ChatHarness

__all__ = ["ChatHarness"]
