"""Drills of `primerl launch ssh --max-restarts` (ssh_drills.py) on the SSH hosts of the launcher tests: one of two
inference servers, or one rank of a trainer split over two hosts, SIGKILLed mid-run; or that rank SIGSTOPped (hung).
The launcher restarts the whole run by itself: every step is trained once, on the same tasks as an uninterrupted
launch, at most one step redone."""

from __future__ import annotations

import os

import pytest
from drill_records import assert_nothing_lost
from ssh_drills import FAULTS, HUNG_RANK, INFERENCE, MAX_RESTARTS, STALL_TIMEOUT_S, run_ssh_drill, run_uninterrupted

from primerl.launch.restart import STALLED
from primerl.recipes.manifest import read_manifest

pytestmark = pytest.mark.drills


@pytest.fixture(autouse=True)
def _opt_in():
    if os.environ.get("PRIMERL_DRILLS") != "1":
        pytest.skip("the drills are opt-in (PRIMERL_DRILLS=1 pytest -m drills; .ci/run runs them as their own group)")


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    run_dir, done = run_uninterrupted(cluster, tmp_path_factory.mktemp("ssh-uninterrupted"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_process_of_two_killed_on_its_host_the_launcher_restarts_the_run_which_finishes(fault, cluster, tmp_path,
                                                                                           uninterrupted):
    row = run_ssh_drill(cluster, fault, tmp_path, uninterrupted)
    assert row["outcome"] == "finished" and row["exit_code"] == 0, row
    assert row["restarts"] == 1, row
    # a killed server exits by the signal; a killed rank makes its torchrun node exit 1 (b's, or a's if its rank
    # failed on the lost peer first)
    causes = ([f"{FAULTS[fault][1]} was killed by signal 9"] if fault == INFERENCE
              else ["trainer.1 on host b exited with code 1", "trainer.0 on host a exited with code 1"])
    assert len(row["causes"]) == 1 and row["causes"][0] in causes, row
    assert len(row["restart_lines"]) == 1 and row["restart_lines"][0].startswith(
        f"launch: restart 1/{MAX_RESTARTS}: {row['causes'][0]} at step "), row
    assert_nothing_lost(row, tmp_path / "run", uninterrupted)


def test_a_rank_hung_on_its_host_the_launcher_sees_the_stall_stops_every_host_and_the_run_finishes(cluster, tmp_path,
                                                                                                  uninterrupted):
    """The trainer rank on b SIGSTOPped after the first step: alive, holding its sockets, silent; its peer on a waits
    in a collective. No new metrics record for stall_timeout_s: the launcher stops every process on both hosts (the
    stopped rank, which only SIGKILL ends, included), restarts the run, and it finishes with nothing lost."""
    row = run_ssh_drill(cluster, HUNG_RANK, tmp_path, uninterrupted)
    assert row["outcome"] == "finished" and row["exit_code"] == 0, row
    cause = f"{STALLED} made no progress (no new metrics record) for {STALL_TIMEOUT_S}s"
    assert row["restarts"] == 1 and row["causes"] == [cause], row
    assert len(row["restart_lines"]) == 1 and row["restart_lines"][0].startswith(
        f"launch: restart 1/{MAX_RESTARTS}: {cause} at step "), row
    assert row["processes_left"] == {"a": 0, "b": 0}, row
    assert_nothing_lost(row, tmp_path / "run", uninterrupted)
    rl = read_manifest(tmp_path / "run")["stages"]["rl"]
    assert (rl["status"], rl["restarts"]) == ("completed", 1), rl
    [entry] = rl["restart_entries"]
    assert (entry["process"], entry["host"], entry["cause"]) == (STALLED, None, cause.removeprefix(f"{STALLED} "))
