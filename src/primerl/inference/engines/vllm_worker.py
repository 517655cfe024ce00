"""The part of the vLLM engine (primerl.inference.engines.vllm) that runs inside vLLM's worker processes: loading
weights into the running model, from a snapshot directory, the trainer's shared buffer or the weight broadcast.

Imports nothing of vLLM: vLLM mixes the class into its worker class by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`), called through `collective_rpc` on every worker:
    `primerl_load_weights` loads a weights directory into the running model; `primerl_load_shared` loads the
    trainer's shared CUDA buffer (mapped once per segment through its IPC handle; `load_weights` copies from views of
    it, nothing goes through the disk); `primerl_broadcast_join` and `primerl_broadcast_receive` make the worker one
    receiver rank of the trainer's weight group."""

    def primerl_load_weights(self, path: str) -> int:
        from safetensors.torch import safe_open

        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
        if not files:
            raise FileNotFoundError(f"no safetensors weights at {path}")

        def tensors() -> Any:
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                        yield name, f.get_tensor(name)

        loaded = self.model_runner.get_model().load_weights(weights=tensors())  # type: ignore[attr-defined]
        return len(loaded) if loaded is not None else 0

    def primerl_load_shared(self, snapshot: str, run_dir: str) -> int:
        """Load the version `snapshot` (a SHARED marker directory) points at from the trainer's buffer on this GPU;
        returns once the copies are done, so the trainer may overwrite the buffer."""
        import torch

        from primerl.transport.shared import SharedReader

        reader = getattr(self, "_primerl_shared_reader", None)
        if reader is None:
            reader = self._primerl_shared_reader = SharedReader(torch.device("cuda", torch.cuda.current_device()))
        views = reader.tensors(snapshot, run_dir)
        loaded = self.model_runner.get_model().load_weights(weights=iter(views.items()))  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        return len(loaded) if loaded is not None else len(views)

    def primerl_broadcast_join(self, host: str, port: int, init_timeout_s: float, timeout_s: float) -> None:
        """Start joining the weight group as a receiver on this worker's GPU; returns at once (the join waits for
        the trainer, up to `init_timeout_s`, in a background thread so the worker keeps serving)."""
        import threading

        import torch

        from primerl.transport.broadcast_receiver import BroadcastReceiver

        receiver = BroadcastReceiver(host, port, device=torch.device("cuda", torch.cuda.current_device()),
                                     init_timeout_s=init_timeout_s, timeout_s=timeout_s)
        joined = threading.Event()
        self._primerl_receiver, self._primerl_joined, self._primerl_join_error = receiver, joined, None

        def join() -> None:
            try:
                receiver.join()
            except Exception as e:  # noqa: BLE001 - reported by primerl_broadcast_receive
                self._primerl_join_error = str(e)
            finally:
                joined.set()

        threading.Thread(target=join, name="primerl-weights-join", daemon=True).start()

    def primerl_broadcast_receive(self, transfer: dict[str, Any]) -> dict[str, Any]:
        """Receive one announced transfer (the engine is paused) into the model in place, bucket by bucket. Never
        raises: returns {"rank", "error", "seconds", "num_bytes"} so the engine can confirm for every rank."""
        import time

        from primerl.transport.broadcast import Transfer

        receiver = getattr(self, "_primerl_receiver", None)
        if receiver is None:
            return {"rank": None, "error": "primerl_broadcast_join was not called", "seconds": 0.0, "num_bytes": 0}
        self._primerl_joined.wait(receiver.feed.init_timeout_s)
        if receiver.rank is None:
            error = self._primerl_join_error or "not joined to the weight group yet"
            return {"rank": None, "error": error, "seconds": 0.0, "num_bytes": 0}
        announced = Transfer.from_dict(transfer)
        started = time.perf_counter()
        try:
            self.model_runner.get_model().load_weights(weights=receiver.receive(announced))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - returned to the engine, which tells the trainer
            return {"rank": receiver.rank, "error": str(e).splitlines()[0] or type(e).__name__,
                    "seconds": time.perf_counter() - started, "num_bytes": 0}
        return {"rank": receiver.rank, "error": None, "seconds": time.perf_counter() - started,
                "num_bytes": announced.manifest.num_bytes}
