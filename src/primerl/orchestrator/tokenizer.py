"""The renderer's tokenizer and renderer choice, without importing torch.

verifiers' renderer client builds its renderer with `renderers.create_renderer(renderers.base.load_tokenizer(model),
config)`. Both steps build the model's transformers config: `load_tokenizer` calls `AutoTokenizer.from_pretrained`,
which builds it to pick the tokenizer class, and the automatic renderer choice, for a model not in renderers' table
(any local directory), builds it with `AutoConfig` to refuse vision models. transformers' config module imports torch
(through `generation.logits_process`), and the auto classes pull `torch._dynamo` and `torch.distributed.tensor`: 5-7
CPU-seconds of imports in an orchestrator that never runs a tensor op, on the critical path of every launch (P5,
`benchmarks/NOTES.md`). The tokenizer itself loads in well under a second.

- Tokenizer: where the model directory names its tokenizer class in `tokenizer_config.json` and that class is the
  generic tokenizers-backed one (every model primerl prepares, and any repository that ships a self-contained
  `tokenizer.json` with it), `AutoTokenizer` resolves exactly that class and calls its `from_pretrained`; this
  module does the same without the config. Everything else (remote code, an `auto_map`, a model-specific class, a
  hub id) goes to renderers' own loader unchanged.
- Renderer: for a local directory of a text-only architecture the fast decoder supports (`config.json`'s
  `model_type` llama, qwen2 or qwen3, no vision keys), the automatic choice is always the chat-template renderer
  (`DefaultRendererConfig`), so it is named explicitly and the vision probe is skipped. Hub ids and other models keep
  the automatic choice.

`tests/orchestrator/test_tokenizer.py` checks that both give the same tokenizer and renderer as renderers' own path,
and that a renderer built through verifiers' client leaves torch unimported.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

# Architectures whose transformers config has no vision part: renderers' automatic choice for a local directory of one
# of these is always the chat-template renderer.
TEXT_ONLY_TYPES = frozenset({"llama", "qwen2", "qwen3"})
VISION_KEYS = ("vision_config", "vision_tower", "image_token_id")

# The class names `AutoTokenizer` maps to the generic tokenizers-backed class (in transformers 5 both name it).
GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def direct_class_name(model: str | Path) -> str | None:
    """The generic tokenizer class that `AutoTokenizer` would pick for the local model directory `model`, or None
    where its choice needs the model's config (or remote code, or a download)."""
    path = Path(model)
    config_path = path / "tokenizer_config.json"
    if not (path.is_dir() and config_path.is_file() and (path / "tokenizer.json").is_file()):
        return None
    config = _json(config_path)
    if config is None or "auto_map" in config:  # an unreadable config: the regular loader reports it
        return None
    name = config.get("tokenizer_class")
    return name if name in GENERIC_CLASSES else None


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def chat_template_renderer(model: str | Path) -> Any:
    """`DefaultRendererConfig()` where renderers' automatic choice for the model directory `model` is that renderer
    and can be known from its `config.json` alone (see the module's text), else None (choose automatically)."""
    from renderers.base import MODEL_RENDERER_MAP, MULTIMODAL_MODELS

    path = Path(model)
    if not path.is_dir() or str(model) in MODEL_RENDERER_MAP or str(model) in MULTIMODAL_MODELS:
        return None
    config = _json(path / "config.json")
    if config is None or config.get("model_type") not in TEXT_ONLY_TYPES or any(k in config for k in VISION_KEYS):
        return None
    from renderers.configs import DefaultRendererConfig

    return DefaultRendererConfig()


def load_tokenizer(model: str | Path, fallback: Any = None) -> Any:
    """`model`'s tokenizer: the generic class's `from_pretrained` where `direct_class_name` allows it, else
    `fallback(model)` (renderers' own loader when installed)."""
    name = direct_class_name(model)
    if name is None:
        if fallback is None:
            from renderers.base import load_tokenizer as fallback
        return fallback(model)
    import transformers

    return getattr(transformers, name).from_pretrained(str(model))


def install_renderer_tokenizer_loader() -> None:
    """Make renderers' `load_tokenizer` (which verifiers calls at each renderer build) take the direct path where it
    applies. Idempotent."""
    import renderers.base

    current = renderers.base.load_tokenizer
    if getattr(current, "primerl_direct", False):
        return

    @functools.wraps(current)
    def load(model_name_or_path: str) -> Any:
        return load_tokenizer(model_name_or_path, fallback=current)

    load.primerl_direct = True
    renderers.base.load_tokenizer = load
