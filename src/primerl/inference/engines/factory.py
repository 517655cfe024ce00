"""Build the engine `primerl inference` serves, and describe it in one line.

`build_engine(cfg)` makes the engine `cfg.engine` names — the embedded engine (`hf`) on the resolved model, or vLLM —
without starting it; the vLLM package is imported only when asked for, and a missing one raises EngineUnavailable.
`describe_engine` gives the facts a user needs to trust what is served.
"""

from __future__ import annotations

from primerl.config.inference import InferenceConfig
from primerl.inference.engines.base import Engine


def build_engine(cfg: InferenceConfig) -> Engine:
    """The engine `cfg.engine` names, not started. Raises EngineUnavailable when its package is missing."""
    served_name = cfg.served_model_name or cfg.model.name
    if cfg.engine == "vllm":
        from primerl.inference.engines.vllm import VLLMEngine

        return VLLMEngine(
            cfg.model, served_name, max_model_len=cfg.max_model_len, options=cfg.vllm, max_batch_size=cfg.max_batch_size,
            seed=cfg.seed,
        )
    from primerl.inference.engines.hf import HFEngine
    from primerl.models import resolve_model

    return HFEngine(
        resolve_model(cfg.model.name, cfg.model.revision),
        model_name=served_name,
        device=cfg.device,
        dtype=cfg.model.dtype,
        max_batch_size=cfg.max_batch_size,
        max_model_len=cfg.max_model_len,
        decode_steps=cfg.decode_steps,
        overlap=cfg.overlap,
        compile=cfg.compile,
        threads=cfg.threads,
        seed=cfg.seed,
    )


def describe_engine(engine: Engine) -> str:
    """The facts a user needs to trust what is served: model, engine, size, dtype, device, context length."""
    model = getattr(engine, "model", None)
    n_params = sum(p.numel() for p in model.parameters()) if model is not None and hasattr(model, "parameters") else 0
    size = f"{n_params / 1e6:.1f}M params" if n_params else "params unknown"
    return (
        f"model={engine.model_name} engine={type(engine).__name__} {size} dtype={getattr(engine, 'dtype', '?')} "
        f"device={getattr(engine, 'device', '?')} max_model_len={engine.max_model_len} "
        f"max_batch_size={getattr(engine, 'max_batch_size', '?')} policy_version={engine.policy_version}"
    )
