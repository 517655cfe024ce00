"""Drills of `primerl launch ssh --max-restarts` (ssh_drills.py) on the SSH hosts of the launcher tests: one of two
inference servers, or one rank of a trainer split over two hosts, SIGKILLed mid-run. The launcher restarts the whole
run by itself: every step is trained once, on the same tasks as an uninterrupted launch, at most one step redone."""

from __future__ import annotations

import os

import pytest
from drill_records import assert_nothing_lost
from ssh_drills import FAULTS, INFERENCE, MAX_RESTARTS, run_ssh_drill, run_uninterrupted

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
