"""The loop's parts on their own: hooks' cadence (Hook.due, TrainerHooks.schedule) and the step
generator (training_steps), with plain Python steps and no device."""

from __future__ import annotations

import signal
from collections.abc import Iterator

from kiln.train.hooks import Hook, StopSignals, SyncPoint, TrainerHooks
from kiln.train.trainer import training_steps


def point(step: int, *, final: bool = False) -> SyncPoint:
    return SyncPoint(step, state=None, final=final, ending=final, save=None, signum=None)


def test_a_hook_is_due_at_its_multiples_and_the_last_step() -> None:
    every_3, always = Hook(lambda _: None, every=3), Hook(lambda _: None, every=None)
    assert [s for s in range(1, 11) if every_3.due(point(s))] == [3, 6, 9]
    assert every_3.due(point(10, final=True))
    assert all(always.due(point(s)) for s in range(1, 11))


def test_only_hooks_with_a_cadence_make_sync_points_and_all_run_in_order() -> None:
    hooks = TrainerHooks()
    ran: list[tuple[str, int]] = []
    hooks.add_hook(lambda p: ran.append(("every 4", p.step)), every=4)
    hooks.add_hook(lambda p: ran.append(("always", p.step)))
    hooks.add_hook(lambda p: ran.append(("every 6", p.step)), every=6)
    assert [s for s in range(1, 13) if hooks.schedule(s, final=False)] == [4, 6, 8, 12]
    assert hooks.schedule(13, final=True)
    for step in (4, 6, 12):
        hooks.run_hooks(point(step))
    assert ran == [
        ("every 4", 4), ("always", 4), ("always", 6), ("every 6", 6),
        ("every 4", 12), ("always", 12), ("every 6", 12),
    ]  # fmt: skip
    without_cadence = TrainerHooks()
    without_cadence.add_hook(lambda p: None)
    assert not any(without_cadence.schedule(s, final=False) for s in range(1, 50))


def test_training_steps_take_one_batch_a_step_and_thread_the_state() -> None:
    taken: list[int] = []

    def batches() -> Iterator[int]:
        batch = 0
        while True:
            taken.append(batch)
            yield batch
            batch += 1

    def train_step(state: int, batch: int) -> tuple[int, dict[str, int]]:
        return state + batch, {"batch": batch}

    with StopSignals() as signals:
        infos = list(training_steps(train_step, 100, batches(), range(4, 8), signals=signals,
                                    total=10))  # fmt: skip
    assert [i.step for i in infos] == [4, 5, 6, 7]
    assert [i.state for i in infos] == [100, 101, 103, 106]  # each the state after its step
    assert [i.metrics["batch"] for i in infos] == [0, 1, 2, 3] and taken == [0, 1, 2, 3]
    assert [i.stopping_early for i in infos] == [False, False, False, True]  # 7 < total 10
    assert all(i.signum is None and i.data_wait >= 0 for i in infos)


def test_a_signal_reaches_the_next_step_yielded() -> None:
    def train_step(state: int, batch: int) -> tuple[int, dict[str, int]]:
        return state + 1, {}

    with StopSignals() as signals:
        steps = training_steps(train_step, 0, iter(range(100)), range(1, 5), signals=signals,
                               total=4)  # fmt: skip
        first = next(steps)
        signal.raise_signal(signal.SIGTERM)
        second = next(steps)
    assert first.signum is None and second.signum == signal.SIGTERM
    assert not second.stopping_early  # the run's own end is not an early stop


def test_a_stop_noted_before_the_loop_reaches_its_first_step(monkeypatch) -> None:
    """A SIGTERM whose exception Python dropped before training (kiln.runner notes it) stops
    the loop at its first step all the same."""

    def train_step(state: int, batch: int) -> tuple[int, dict[str, int]]:
        return state + 1, {}

    monkeypatch.setattr(StopSignals, "noted_before", signal.SIGTERM)
    with StopSignals() as signals:
        steps = training_steps(train_step, 0, iter(range(100)), range(1, 5), signals=signals,
                               total=4)  # fmt: skip
        assert next(steps).signum == signal.SIGTERM
