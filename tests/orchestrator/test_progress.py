"""Orchestrator checkpoints, where a resumed orchestrator continues, and the seeded task order."""

from dataclasses import asdict, dataclass

from primerl.orchestrator.progress import Progress, load_progress, resume_progress, save_progress, saved_steps
from primerl.orchestrator.sampler import TaskStream
from primerl.transport.rollouts import Sample, write_batch


def test_progress_round_trips_and_old_checkpoints_are_pruned(tmp_path):
    for step in range(1, 5):
        save_progress(tmp_path, Progress(next_step=step, tasks_drawn=3 * step, rollouts=10 * step), keep_last=2)
    assert saved_steps(tmp_path) == [3, 4]
    assert load_progress(tmp_path) == Progress(next_step=4, tasks_drawn=12, rollouts=40)
    assert not (tmp_path / "checkpoints" / "step_1").exists()


def test_pruning_leaves_the_trainers_checkpoints_alone(tmp_path):
    (tmp_path / "checkpoints" / "step_1" / "trainer").mkdir(parents=True)
    for step in (1, 2, 3):
        save_progress(tmp_path, Progress(next_step=step), keep_last=1)
    assert (tmp_path / "checkpoints" / "step_1" / "trainer").is_dir()
    assert not (tmp_path / "checkpoints" / "step_1" / "orchestrator").exists()


def _publish(run_dir, step):
    sample = Sample(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], inference_logprobs=[0.0, -1.0, -1.0], advantages=0.5)
    write_batch(run_dir, step, [sample], seq_len=8)


def test_resume_continues_after_batches_published_since_the_checkpoint(tmp_path):
    assert resume_progress(tmp_path) == Progress()
    save_progress(tmp_path, Progress(next_step=2, tasks_drawn=4), keep_last=2)
    assert resume_progress(tmp_path).next_step == 2
    for step in (0, 1, 2, 3):
        _publish(tmp_path, step)
    progress = resume_progress(tmp_path)
    assert (progress.next_step, progress.tasks_drawn) == (4, 4)


@dataclass
class FakeTaskset:
    items: list
    bounded: bool = True

    def __iter__(self):
        return iter(self.items) if self.bounded else iter(range(10**9))


def test_task_order_is_seeded_covers_each_pass_and_resumes():
    items = list(range(10))
    stream = TaskStream(FakeTaskset(items), seed=3)
    first = [stream.next()[1] for _ in range(25)]
    assert sorted(first[:10]) == items and sorted(first[10:20]) == items
    assert first[:10] != first[10:20]  # a fresh shuffle per pass
    again = TaskStream(FakeTaskset(items), seed=3)
    assert first == [again.next()[1] for _ in range(25)]
    resumed = TaskStream(FakeTaskset(items), seed=3, drawn=12)
    assert [resumed.next()[1] for _ in range(13)] == first[12:]
    other = TaskStream(FakeTaskset(items), seed=4)
    assert first != [other.next()[1] for _ in range(25)]


def test_infinite_tasksets_are_read_in_order_and_skipped_on_resume():
    stream = TaskStream(FakeTaskset([], bounded=False), seed=0, drawn=5)
    assert [stream.next()[1] for _ in range(3)] == [5, 6, 7]


def test_tasks_in_flight_are_drawn_again_first_after_a_resume():
    items = list(range(10))
    stream = TaskStream(FakeTaskset(items), seed=3)
    draws = [stream.next() for _ in range(25)]
    assert [index for index, _ in draws] == list(range(25))
    # the run stopped with draws 12 and 14 in flight (their groups in no batch): they come first, then draw 15 on
    resumed = TaskStream(FakeTaskset(items), seed=3, drawn=15, redo=[14, 12])
    assert resumed.redo_left == [12, 14]
    assert [resumed.next() for _ in range(5)] == [draws[12], draws[14], *draws[15:18]]
    infinite = TaskStream(FakeTaskset([], bounded=False), seed=0, drawn=5, redo=[3])
    assert [infinite.next() for _ in range(2)] == [(3, 3), (5, 5)]


def test_resume_takes_the_progress_recorded_with_the_newest_batch(tmp_path):
    save_progress(tmp_path, Progress(next_step=1, tasks_drawn=4, tasks_in_flight=[2, 3]), keep_last=2)
    sample = Sample(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], inference_logprobs=[0.0, -1.0, -1.0], advantages=0.5)
    recorded = Progress(next_step=3, tasks_drawn=9, tasks_in_flight=[7, 8], rollouts=24)
    write_batch(tmp_path, 2, [sample], seq_len=8, extra={"progress": asdict(recorded)})
    assert resume_progress(tmp_path) == recorded
