"""Which harness and runtime an environment loaded by id runs with, and the refusal to run tools unsandboxed.

The environments are the test packages under tests/environments/packages/, installed by the `probe_envs` fixture."""

from __future__ import annotations

import asyncio

import pytest
import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.runtimes import provision_runtime

from primerl.config import config_from_argv
from primerl.config.eval import EvalConfig
from primerl.config.orchestrator import EnvSection, OrchestratorConfig
from primerl.orchestrator.envkit import ChatHarness, ShellHarness, ShellHarnessConfig, in_process_endpoint
from primerl.orchestrator.verifiers_bridge import (
    DEFAULT_HARNESS,
    UnsandboxedToolsError,
    env_from_config,
    load_env,
    one_line,
    task_id,
)

pytestmark = pytest.mark.usefixtures("probe_envs")


def harnesses(env: vf.Env) -> dict[str, vf.Harness]:
    """Each agent role's harness, as the env's agents load it (by the role's resolved harness id)."""
    return {role: vf.load_harness(config) for role, config in env.config.agent_harnesses().items()}


def test_a_taskset_alone_gets_the_in_process_chat_harness() -> None:
    assert vf.default_harness_id("probe-taskset") == "bash"  # what verifiers alone would run
    (harness,) = harnesses(load_env("probe-taskset")).values()
    assert type(harness) is ChatHarness and harness.config.id == DEFAULT_HARNESS


def test_a_taskset_with_its_own_harness_keeps_it() -> None:
    (harness,) = harnesses(load_env("probe-harnessed")).values()
    assert type(harness).__name__ == "OneCallHarness" and harness.config.id == "probe-harnessed"


def test_every_role_of_a_multi_turn_env_gets_the_chat_harness() -> None:
    env = load_env("probe-multiturn")
    assert type(env).__name__ == "RepeatEnv"
    assert {role: type(h) for role, h in harnesses(env).items()} == {"player": ChatHarness}


def test_env_harness_overrides_every_role() -> None:
    for env_id in ("probe-taskset", "probe-harnessed", "probe-multiturn"):
        assert all(type(h) is NullHarness for h in harnesses(load_env(env_id, harness="null")).values())


@pytest.mark.parametrize(("env_id", "harness", "shown"), [("probe-tools", None, "probe-tools"),
                                                          ("probe-taskset", "bash", "bash")])
def test_a_harness_with_shell_or_file_tools_is_refused_on_the_host(env_id, harness, shown) -> None:
    with pytest.raises(UnsandboxedToolsError) as refused:
        load_env(env_id, harness=harness)
    message = str(refused.value)
    assert "\n" not in message and f"harness {shown!r}" in message
    assert "--env.allow_unsandboxed_tools true" in message and "--env.runtime.type docker" in message


def test_tool_harnesses_load_when_sandboxed_or_explicitly_allowed() -> None:
    allowed = env_from_config(EnvSection(id="probe-tools", allow_unsandboxed_tools=True))
    assert type(harnesses(allowed)["agent"]) is ShellHarness
    section = EnvSection(id="probe-tools", runtime={"type": "docker", "image": "base:test"})
    sandboxed = env_from_config(section)  # loading provisions nothing: containers start per rollout
    assert sandboxed.config.agent.runtime == vf.DockerConfig(image="base:test")


def test_stable_task_ids() -> None:
    first = [task_id(t) for t in load_env("probe-taskset").taskset]
    assert first == [task_id(t) for t in load_env("probe-taskset").taskset] and len(set(first)) == len(first)
    assert next(task_id(t) for t in load_env("probe-tools", allow_unsandboxed_tools=True).taskset) == "product-6x7"


def test_a_harness_error_is_reported_with_its_root_cause_on_one_line() -> None:
    error = (
        "HarnessError: harness 'bash' exited 1: ...py\", line 984, in main\n    raise RuntimeError(msg)\n"
        "RuntimeError: the chat template of this model does not support tools\n"
    )
    assert one_line(error) == (
        "HarnessError: harness 'bash' exited 1: RuntimeError: the chat template of this model does not support tools"
    )
    assert one_line("ProviderError: upstream 404: model 'x' is not served here") == (
        "ProviderError: upstream 404: model 'x' is not served here"
    )


def test_shell_tool_runs_in_the_runtime_and_reports_exit_code_and_timeout() -> None:
    harness = ShellHarness(ShellHarnessConfig(id="probe-tools", command_timeout_s=2))

    async def go() -> list[str]:
        async with provision_runtime(vf.SubprocessConfig()) as runtime:
            (shell,) = harness.runtime_tools(runtime)
            assert in_process_endpoint("http://127.0.0.1:9/v1", runtime) == "http://127.0.0.1:9/v1"
            return [await shell.call('{"command": "echo $((6*7)); exit 3"}'),
                    await shell.call('{"command": "sleep 30"}')]

    done, slow = asyncio.run(go())
    assert done == "exit code 3\n42\n"
    assert slow == "error: the command ran longer than 2s and was stopped"


@pytest.mark.parametrize("config", [EvalConfig, OrchestratorConfig])
def test_env_keys_are_documented_in_help(config, capsys) -> None:
    with pytest.raises(SystemExit):
        config_from_argv(config, ["--help"], prog="primerl")
    shown = capsys.readouterr().out
    for key in ("--env.harness", "--env.runtime.type", "--env.runtime.image", "--env.allow_unsandboxed_tools"):
        assert key in shown, key
