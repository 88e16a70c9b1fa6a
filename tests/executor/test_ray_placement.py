"""`RayPlacement` (executor/supervisor.py), the one place both Ray users (the `ray` executor's
ranks, `serve -dp --data-parallel-backend ray`'s replicas) join or start Ray and place, start and
release their actors: Ray is stopped only when it started it, the group is removed and the
actors killed in one call, a group that cannot be placed fails the start with the shared
`WorkerStartupError`. A stand-in `ray` module records the calls (no cluster: milliseconds)."""

from __future__ import annotations

import sys
import types

import pytest

from pagedllm.executor.errors import WorkerStartupError
from pagedllm.executor.supervisor import RayPlacement


class _GetTimeoutError(Exception):
    pass


class _FakeRay(types.ModuleType):
    """Enough of Ray for `RayPlacement`: every call is recorded in `calls`."""

    def __init__(self, running: bool, placeable: bool = True) -> None:
        super().__init__("ray")
        self.running, self.placeable, self.calls, self.actors = running, placeable, [], 0
        self.exceptions = types.SimpleNamespace(GetTimeoutError=_GetTimeoutError)

    def is_initialized(self) -> bool:
        return self.running

    def init(self, **kwargs) -> None:
        self.running = True
        self.calls.append("init")

    def shutdown(self) -> None:
        self.running = False
        self.calls.append("shutdown")

    def get(self, ref, timeout=None):
        if ref == "ready" and not self.placeable:
            raise _GetTimeoutError
        return ref

    def available_resources(self) -> dict:
        return {"CPU": 1.0}

    def kill(self, actor, no_restart=True) -> None:
        self.calls.append(f"kill {actor}")

    def remote(self, **options):
        def actor_class(cls):
            def new_actor() -> str:
                self.actors += 1
                return f"{cls.__name__}#{self.actors}"

            return types.SimpleNamespace(
                options=lambda **_: types.SimpleNamespace(remote=new_actor)
            )

        return actor_class


@pytest.fixture
def fake_ray(monkeypatch):
    def install(running: bool, placeable: bool = True) -> _FakeRay:
        ray = _FakeRay(running, placeable)
        group = types.SimpleNamespace(ready=lambda: "ready")

        def placement_group(bundles, strategy):
            ray.calls.append(f"place {len(bundles)} {strategy}")
            return group

        def remove_placement_group(g):
            ray.calls.append("remove group")

        modules = {
            "ray": ray,
            "ray.util": types.ModuleType("ray.util"),
            "ray.util.placement_group": types.SimpleNamespace(
                placement_group=placement_group, remove_placement_group=remove_placement_group
            ),
            "ray.util.scheduling_strategies": types.SimpleNamespace(
                PlacementGroupSchedulingStrategy=lambda group, placement_group_bundle_index: None
            ),
        }
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return ray

    return install


class Rank:
    pass


def test_a_ray_it_started_is_stopped_with_the_actors_and_the_group(fake_ray):
    ray = fake_ray(running=False)
    placement = RayPlacement()
    placement.place([{"CPU": 1}] * 2, "PACK", "tensor_parallel_size=2", 1.0)
    placement.start(1, Rank, num_cpus=1)
    placement.release()
    placement.release()  # idempotent
    assert ray.calls == ["init", "place 2 PACK", "kill Rank#1", "remove group", "shutdown"]
    assert placement.actors == {} and placement.group is None


def test_a_running_cluster_is_joined_and_left_running(fake_ray):
    ray = fake_ray(running=True)
    placement = RayPlacement()
    placement.place([{"CPU": 2}], "SPREAD", "data_parallel_size=1", 1.0)
    placement.release()
    assert ray.calls == ["place 1 SPREAD", "remove group"] and ray.running


def test_an_actor_started_again_in_its_bundle_replaces_the_old_one(fake_ray):
    ray = fake_ray(running=True)
    placement = RayPlacement()
    placement.place([{"CPU": 1}], "SPREAD", "data_parallel_size=1", 1.0)
    first = placement.start(0, Rank, num_cpus=1)
    second = placement.start(0, Rank, num_cpus=1)
    assert first != second
    assert ray.calls[-1] == f"kill {first}" and placement.actors == {0: second}
    placement.release()


def test_a_group_that_cannot_be_placed_is_a_startup_error_naming_its_use(fake_ray):
    fake_ray(running=False, placeable=False)
    placement = RayPlacement()
    with pytest.raises(WorkerStartupError, match=r"data_parallel_size=4: .* 4 bundles of 2 CPU"):
        placement.place([{"CPU": 2}] * 4, "SPREAD", "data_parallel_size=4", 0.1)
    placement.release()
