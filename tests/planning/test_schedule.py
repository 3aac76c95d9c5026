import math

import pytest

from pipeline.errors import UserError
from pipeline.planning.schedule import lr_factor, plan_stages


def test_seed_schedule_15000_updates():
    stages = plan_stages(15000, 0.05, 8)
    assert [(s.name, s.updates) for s in stages] == (
        [("pilot", 750)] + [(f"chunk{i:02d}", 1781) for i in range(1, 9)] + [("tail", 2)]
    )
    assert stages[0].start == 0 and stages[-1].end == 15000
    assert all(a.end == b.start for a, b in zip(stages, stages[1:]))


def test_default_config_plans_pilot_two_chunks_and_tail():
    import yaml

    cfg = yaml.safe_load(open("config/config.yaml"))["schedule"]
    names = [s.name for s in plan_stages(cfg["total_updates"], cfg["pilot_fraction"], cfg["num_chunks"])]
    assert names[0] == "pilot" and names[-1] == "tail" and sum(n.startswith("chunk") for n in names) >= 2


def test_no_tail_when_chunks_divide_evenly_and_names_sort():
    names = [s.name for s in plan_stages(126, 0.05, 12)]
    assert names[-1] == "chunk12" and "tail" not in names and names[1:] == sorted(names[1:])


@pytest.mark.parametrize("args", [(0, 0.05, 2), (100, 0.0, 2), (100, 1.0, 2), (100, 0.05, 0), (10, 0.01, 2)])
def test_bad_schedules_are_refused(args):
    with pytest.raises(UserError):
        plan_stages(*args)


def test_lr_warmup_then_cosine_over_the_whole_run():
    total = 100
    f = [lr_factor(s, total, 0.1, 0.1) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    assert f[-1] == pytest.approx(0.1) and math.isclose(max(f), 1.0)
