"""The 2-worker launch lane's scheduling (tests/helpers.py launch_scheduler): xdist's own loadscope scheduler,
driven here with two stand-in workers, never splits a group: a directory whose session fixtures several files share
(one Slurm cluster, one set of Megatron launches) runs on one worker, and a file's tests run on one worker in their
order."""

import re
from pathlib import Path

from helpers import SESSION_LAUNCHES, launch_group, launch_scheduler


class Worker:
    """What the scheduler sends to: the test indices it was given, in order."""

    def __init__(self, name):
        self.name, self.given, self.shutting_down = name, [], False
        self.gateway = type("Gateway", (), {"id": name})()

    def send_runtest_some(self, indices):
        self.given += indices

    def send_runtest_all(self):
        raise AssertionError("a scope scheduler sends work units, not the whole collection")

    def shutdown(self):
        self.shutting_down = True


class LoadGroupConfig:
    """The session's own config, asked as a `-n 2 --dist DIST` run would be."""

    def __init__(self, config, dist="loadgroup"):
        self._config, self._asked = config, {"dist": dist, "tx": ["2*popen"]}

    def getvalue(self, name):
        return self._asked[name] if name in self._asked else self._config.getvalue(name)

    def __getattr__(self, name):
        return getattr(self._config, name)


def test_every_group_of_the_launch_lane_runs_whole_on_one_worker_in_file_order(request):
    collection = [f"tests/{path}::test_{i}" for path in (
        "checkpoint/test_restore.py", "checkpoint/test_verify.py", "checkpoint/test_zero_to_hf.py",
        "explore/test_explore_browser.py",
        "megatron/test_megatron_train.py", "megatron/test_megatron_faults.py", "slurm/test_slurm.py",
        "training/test_faults.py", "training/test_train_launch.py") for i in range(3)]
    assert launch_group("tests/checkpoint/test_verify.py::test_0") == "checkpoint"
    assert launch_group(collection[0]) == "checkpoint/test_restore.py"  # launches of its own: either worker
    assert launch_group("tests/training/test_faults.py::test_0") == "training/test_faults.py"
    config = LoadGroupConfig(request.config)
    assert launch_scheduler(LoadGroupConfig(request.config, "load"), None) is None
    scheduler = launch_scheduler(config, None)
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    done = {w.name: 0 for w in workers}
    while not scheduler.tests_finished:  # each worker finishes what it was given, one test at a time
        for worker in workers:
            for index in worker.given[done[worker.name]:]:
                scheduler.mark_test_complete(worker, index)
                done[worker.name] += 1
    ran = {w.name: [collection[i] for i in w.given] for w in workers}
    assert sorted(sum(ran.values(), [])) == sorted(collection)
    for group in {launch_group(n) for n in collection}:
        where = {name for name, ids in ran.items() if any(launch_group(n) == group for n in ids)}
        assert len(where) == 1, (group, ran)
        [name] = where
        mine = [n for n in ran[name] if launch_group(n) == group]
        assert mine == [n for n in collection if launch_group(n) == group]
    assert all(ran.values())  # both workers got work


def test_the_tests_of_each_shared_launch_are_one_group():
    """Every test file that asks for a session fixture that launches is in that launch's group (helpers'
    SHARED_LAUNCHES): on two workers the launch would otherwise run twice. Each fixture is defined once and used."""
    tests = Path(__file__).parents[1]
    files = sorted(tests.rglob("test_*.py"))
    for fixture in SESSION_LAUNCHES:
        defined = [p for p in tests.rglob("conftest.py") if re.search(rf"^def {fixture}\(", p.read_text(), re.M)]
        assert len(defined) == 1, (fixture, defined)
        users = [p for p in files if re.search(rf"\b{fixture}\b", p.read_text())]
        groups = {launch_group(f"{p.relative_to(tests.parent).as_posix()}::test") for p in users}
        assert users and len(groups) == 1, (fixture, groups)
