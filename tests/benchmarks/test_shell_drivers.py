"""The GPU machine's shell drivers (benchmarks/*.sh) cannot run here, so what they call is checked instead: each
parses (`bash -n`), and every benchmark script, `python -m` module, flag, config key and test path they name exists.
A flag, module or test renamed without its driver fails here, not at the start of a GPU session."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
DRIVERS = sorted(BENCHMARKS.glob("*.sh"))
# `python -m primerl.cli COMMAND`: the config each command loads (its flags are that config's keys)
CLI_CONFIGS = {"trainer": "primerl.config.trainer:TrainerConfig"}
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w.-]*")
SCRIPT = re.compile(r"benchmarks/(\w+\.py)")
MODULE = re.compile(r"python3? -m ([\w.]+)")
END_OF_COMMAND = re.compile(r"\s(?:\||&&|\|\||>|2>|&|;)(?:\s|$)")


def logical_lines(path: Path) -> list[str]:
    """The driver's command lines: continuations joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def command_after(line: str, start: int) -> str:
    """The rest of the command that begins at `start`: up to the next pipe, redirection, `&`, `&&` or `;`."""
    rest = line[start:]
    end = END_OF_COMMAND.search(rest)
    return rest[: end.start()] if end else rest


def flags_in(command: str) -> set[str]:
    return {flag.split("=", 1)[0] for flag in FLAG.findall(command)}


def source_flags(path: Path) -> set[str]:
    """The flags a program's source names (argparse's, or a plain `"--x" in sys.argv`); `--no-x` for `--x`."""
    sources = [path] + ([BENCHMARKS / "report.py"] if "add_smoke_flag" in path.read_text() else [])
    names = {node.value for source in sources for node in ast.walk(ast.parse(source.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--")}
    return names | {f"--no-{name[2:]}" for name in names}


def module_file(module: str) -> Path | None:
    base = REPO / "src" / Path(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__main__.py") if p.is_file()), None)


def config_key_exists(config: type[BaseModel], dotted: str) -> bool:
    model: object = config
    for part in dotted.replace("-", "_").split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
    return True


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda p: p.name)
def test_driver_parses(driver: Path):
    bash = shutil.which("bash")
    assert bash, "bash is not on PATH"
    done = subprocess.run([bash, "-n", str(driver)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda p: p.name)
def test_every_script_and_flag_a_driver_runs_exists(driver: Path):
    problems, seen = [], 0
    for line in logical_lines(driver):
        for match in SCRIPT.finditer(line):
            seen += 1
            script = BENCHMARKS / match.group(1)
            if not script.is_file():
                problems.append(f"{match.group(0)}: no such script")
                continue
            unknown = flags_in(command_after(line, match.end())) - source_flags(script)
            problems += [f"{match.group(0)} {flag}: the script has no such flag" for flag in sorted(unknown)]
    assert seen, f"{driver.name} runs no benchmark script"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("driver", DRIVERS, ids=lambda p: p.name)
def test_every_primerl_module_command_and_test_a_driver_runs_exists(driver: Path):
    problems = []
    for line in logical_lines(driver):
        for match in MODULE.finditer(line):
            module, command = match.group(1), command_after(line, match.end()).split()
            if module == "pytest":
                problems += [f"pytest {p}: no such test file" for p in command if p.startswith("tests/")
                             and not (REPO / p).exists()]
            elif module == "primerl.cli":
                problems += cli_problems(command)
            elif module.startswith("primerl."):
                path = module_file(module)
                if path is None:
                    problems.append(f"-m {module}: no such module")
                    continue
                unknown = flags_in(" ".join(command)) - source_flags(path)
                problems += [f"-m {module} {flag}: not a flag of the module" for flag in sorted(unknown)]
    assert not problems, "\n".join(problems)


def cli_problems(command: list[str]) -> list[str]:
    import importlib

    name = command[0]
    if name not in CLI_CONFIGS:
        return [f"primerl.cli {name}: add its config to CLI_CONFIGS in this test"]
    module, _, attr = CLI_CONFIGS[name].partition(":")
    config = getattr(importlib.import_module(module), attr)
    return [f"primerl.cli {name} {flag}: {attr} has no such key" for flag in sorted(flags_in(" ".join(command[1:])))
            if not config_key_exists(config, flag[2:])]


def test_the_checks_catch_a_renamed_flag_a_missing_script_and_a_bad_config_key(tmp_path: Path):
    """The checks above, on a driver that calls what does not exist, report each of it."""
    driver = tmp_path / "broken.sh"
    driver.write_text("#!/usr/bin/env bash\n"
                      "run a 10 python3 benchmarks/trainer.py --tiny --no-such-flag \\\n    --out x.json > log 2>&1\n"
                      "run b 10 python3 benchmarks/no_such_benchmark.py --out y.json\n"
                      "python3 -m primerl.cli trainer @ t.toml --data.fake --weights.no_such_key 1\n"
                      "python3 -m pytest tests/gpu/no_such_test.py -q\n")
    with pytest.raises(AssertionError) as scripts:
        test_every_script_and_flag_a_driver_runs_exists(driver)
    assert "--no-such-flag" in str(scripts.value) and "no_such_benchmark.py: no such script" in str(scripts.value)
    assert "--tiny" not in str(scripts.value) and "--out" not in str(scripts.value)
    with pytest.raises(AssertionError) as modules:
        test_every_primerl_module_command_and_test_a_driver_runs_exists(driver)
    assert "--weights.no_such_key" in str(modules.value) and "no_such_test.py" in str(modules.value)
    assert "--data.fake:" not in str(modules.value)
