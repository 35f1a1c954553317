"""vs_levanter.py's schedule and its reading of differences, without training anything."""

from vs_levanter import KILN_RUNS, LEVANTER, difference, in_time_order


def test_each_main_kiln_run_is_beside_its_levanter_run_and_first_as_often_as_second():
    runs = in_time_order(["quickstart", "quickstart_every_5th"], [0, 1, 2], list(KILN_RUNS))
    assert len(runs) == 2 * 3 * 3
    before = dict.fromkeys(KILN_RUNS, 0)
    for i, run in enumerate(runs):
        if run.label == LEVANTER:
            neighbours = {runs[i - 1], runs[i + 1]}
            assert {(r.corpus, r.seed) for r in neighbours} == {(run.corpus, run.seed)}
            assert {r.label for r in neighbours} == set(KILN_RUNS)
            before[runs[i - 1].label] += 1
    assert before == dict.fromkeys(KILN_RUNS, 3)


def test_a_difference_smaller_than_its_spread_is_within_noise():
    assert difference([0.05, 0.06, 0.07]) == "+0.060 [+0.050, +0.070]"
    assert difference([0.01, 0.04, 0.01]) == "+0.020 [+0.010, +0.040], within noise"
    assert difference([-0.01, 0.02, 0.005]) == "+0.005 [-0.010, +0.020], within noise"
