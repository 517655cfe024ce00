"""torch.compile's and Triton's caches under primerl's cache directory, shared by every process and run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from primerl.cache import COMPILE_CACHE_VARS


def run_python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def clean_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in COMPILE_CACHE_VARS}
    return {**env, "PRIMERL_CACHE": str(cache), **extra}


def test_every_command_compiles_into_the_primerl_cache(tmp_path):
    """A command started through the CLI points torch.compile at `$PRIMERL_CACHE/compile`, and a real compile writes
    its artifacts there (not into the system's temporary directory, which torch uses by default)."""
    code = (
        "import os, torch\n"
        "from primerl.cli import main\n"
        "main(['models', 'list'])\n"
        "f = torch.compile(lambda x: torch.sin(x) * 2 + 1)\n"
        "f(torch.ones(8))\n"
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
        "print(os.environ['TRITON_CACHE_DIR'])\n"
    )
    inductor, triton = run_python(code, clean_env(tmp_path)).strip().splitlines()[-2:]
    assert inductor == str(tmp_path / "compile" / "inductor")
    assert triton == str(tmp_path / "compile" / "triton")
    assert any(path.is_file() for path in Path(inductor).rglob("*")), "the compile wrote nothing under the cache"


def test_a_cache_directory_the_user_set_is_kept(tmp_path):
    mine = tmp_path / "mine"
    code = "import os\nfrom primerl.cache import use_compile_cache\nprint(sorted(use_compile_cache()))\n" \
           "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
    chosen, inductor = run_python(code, clean_env(tmp_path / "c", TORCHINDUCTOR_CACHE_DIR=str(mine))).splitlines()
    assert chosen == "['TRITON_CACHE_DIR']" and inductor == str(mine)


def test_a_child_with_its_own_cache_compiles_into_it(tmp_path, monkeypatch):
    """A process started with another `PRIMERL_CACHE` (a host's own cache, say) does not inherit this process's
    compile cache, which the CLI derived from this process's cache directory; one the user set is inherited."""
    from primerl.cache import use_compile_cache
    from primerl.launch.processes import child_environment

    for var in COMPILE_CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PRIMERL_CACHE", str(tmp_path / "mine"))
    use_compile_cache()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "set-by-the-user"))
    env = child_environment({"PRIMERL_CACHE": str(tmp_path / "theirs")})
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs" / "compile" / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "set-by-the-user")
    assert child_environment()["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine" / "compile" / "inductor")
