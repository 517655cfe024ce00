"""The renderer's tokenizer without torch (`primerl.orchestrator.tokenizer`): the same tokenizer `AutoTokenizer`
gives, the regular loader wherever the direct path does not apply, and a renderer built through verifiers' client in
a process that never imports torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from primerl.orchestrator.tokenizer import (
    chat_template_renderer,
    direct_class_name,
    install_renderer_tokenizer_loader,
    load_tokenizer,
)

MESSAGES = [
    {"role": "system", "content": "Reverse the text character by character."},
    {"role": "user", "content": "  the quick brown fox\n\n jumps ünïcode 😀 <|im_end|> 12345"},
]


MODELS = ["tiny", pytest.param("smollm2-135m-instruct", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model", MODELS)
def test_same_tokenizer_as_auto_tokenizer(model: str) -> None:
    from transformers import AutoTokenizer

    from primerl.models import resolve_model

    path = resolve_model(model)
    assert direct_class_name(path) is not None  # every model primerl prepares takes the direct path
    expected = AutoTokenizer.from_pretrained(path)
    got = load_tokenizer(path, fallback=lambda _: pytest.fail("the direct path fell back"))
    assert type(got) is type(expected)
    assert got.name_or_path == expected.name_or_path
    assert set(vars(got)) == set(vars(expected))
    differing = [k for k in vars(got) if repr(getattr(got, k)) != repr(getattr(expected, k))]
    assert differing == []
    text = MESSAGES[1]["content"]
    assert got.encode(text) == expected.encode(text)
    assert got.all_special_ids == expected.all_special_ids
    assert got.eos_token_id == expected.eos_token_id and got.pad_token_id == expected.pad_token_id
    for generation_prompt in (False, True):
        assert got.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt) == (
            expected.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt))


def _copy_with_config(source: Path, target: Path, file: str = "tokenizer_config.json", **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / file).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / file).write_text(json.dumps(config))
    return target


def test_other_models_go_to_the_regular_loader(tiny_model_dir: Path, tmp_path: Path) -> None:
    auto_map = _copy_with_config(tiny_model_dir, tmp_path / "auto-map", auto_map={"AutoTokenizer": ["x.Tok", None]})
    specific = _copy_with_config(tiny_model_dir, tmp_path / "specific", tokenizer_class="LlamaTokenizer")
    unnamed = _copy_with_config(tiny_model_dir, tmp_path / "unnamed", tokenizer_class=None)
    no_json = _copy_with_config(tiny_model_dir, tmp_path / "no-json")
    (no_json / "tokenizer.json").unlink()
    broken = _copy_with_config(tiny_model_dir, tmp_path / "broken")
    (broken / "tokenizer_config.json").write_text("{not json")
    for model in (auto_map, specific, unnamed, no_json, broken, "HuggingFaceTB/SmolLM2-135M-Instruct",
                  tmp_path / "missing"):
        calls: list = []
        assert direct_class_name(model) is None, model
        assert load_tokenizer(model, fallback=lambda m, calls=calls: calls.append(m) or "regular") == "regular"
        assert calls == [model]


@pytest.mark.parametrize("model", MODELS)
def test_same_renderer_as_the_automatic_choice(model: str, caplog: pytest.LogCaptureFixture) -> None:
    from renderers import create_renderer
    from renderers.configs import DefaultRendererConfig

    from primerl.models import resolve_model

    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    chosen = chat_template_renderer(path)
    assert chosen == DefaultRendererConfig()
    with caplog.at_level("INFO", logger="renderers.base"):
        automatic = create_renderer(tokenizer, None)
    assert "Using DefaultRenderer" in caplog.text  # the automatic choice for this directory is that renderer
    named = create_renderer(tokenizer, chosen)
    assert type(named) is type(automatic)
    for generation_prompt in (False, True):
        assert named.render_ids(MESSAGES, add_generation_prompt=generation_prompt) == (
            automatic.render_ids(MESSAGES, add_generation_prompt=generation_prompt))


def test_other_models_keep_the_automatic_renderer_choice(tiny_model_dir: Path, tmp_path: Path) -> None:
    vision = _copy_with_config(tiny_model_dir, tmp_path / "vision", "config.json", vision_config={"hidden_size": 8})
    image = _copy_with_config(tiny_model_dir, tmp_path / "image", "config.json", image_token_id=5)
    other = _copy_with_config(tiny_model_dir, tmp_path / "other", "config.json", model_type="llava")
    untyped = _copy_with_config(tiny_model_dir, tmp_path / "untyped", "config.json", model_type=None)
    for model in (vision, image, other, untyped, "Qwen/Qwen3-0.6B", tmp_path / "missing"):
        assert chat_template_renderer(model) is None, model


def test_installed_loader_wraps_renderers_once(tiny_model_dir: Path) -> None:
    import renderers.base

    original = renderers.base.load_tokenizer
    try:
        install_renderer_tokenizer_loader()
        installed = renderers.base.load_tokenizer
        install_renderer_tokenizer_loader()
        assert renderers.base.load_tokenizer is installed and installed.primerl_direct
        assert installed.__wrapped__ is original
        tokenizer = installed(str(tiny_model_dir))
        assert tokenizer.name_or_path == str(tiny_model_dir)
    finally:
        renderers.base.load_tokenizer = original


def test_renderer_through_verifiers_client_leaves_torch_unimported(tiny_model_dir: Path) -> None:
    """The orchestrator's path: primerl's renderer client, verifiers' renderer pool building the renderer. Fails if
    verifiers stops loading the tokenizer through `renderers.base.load_tokenizer` at build time, or if anything on
    the way imports torch again."""
    script = textwrap.dedent("""
        import asyncio, json, sys
        from primerl.orchestrator.verifiers_bridge import train_client
        from verifiers.v1.clients.train import ElasticRendererPool

        config = train_client("http://127.0.0.1:9", renderer_model=sys.argv[1])
        async def build():
            pool = ElasticRendererPool(config.renderer_model_name, config.renderer, multiplex=config.multiplex)
            return (await pool.grow()).renderer
        renderer = asyncio.run(build())
        messages = json.loads(sys.argv[2])
        ids = renderer.render_ids(messages, add_generation_prompt=True)
        print(json.dumps({"torch": "torch" in sys.modules, "ids": ids}))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir), json.dumps(MESSAGES)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] is False
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert result["ids"] == list(expected["input_ids"])
