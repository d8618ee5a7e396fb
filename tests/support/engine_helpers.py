"""Reaching past the unit tests' in-process engine (`EngineClient.in_process`) to its core,
and the runner double that injects faults and delays into its steps (`StepFaults`)."""

from __future__ import annotations

from collections.abc import Callable

from engine.client import EngineClient
from engine.core import EngineCore, LaunchedStep, Runner
from engine.in_process import InProcessCoreClient
from scheduler.output import SchedulerOutput


def core_of(engine: EngineClient) -> EngineCore:
    """The EngineCore an in-process engine steps: its scheduler, its runner."""
    client = engine._client
    assert isinstance(client, InProcessCoreClient), "only an in-process engine has a core here"
    return client.core


class StepFaults:
    """A runner between the core and its own: `launch` calls `on_launch(plan)` (when set,
    on the core's thread, after schedule()), then the runner it wraps. An Exception raised
    there fails the step as the runner's would; any other BaseException ends the core's
    loop; a sleep or a wait there delays the step."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.on_launch: Callable[[SchedulerOutput], None] | None = None

    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        if self.on_launch is not None:
            self.on_launch(scheduler_output)
        return self.runner.launch(scheduler_output)


def step_faults(engine: EngineClient | EngineCore) -> StepFaults:
    """The `StepFaults` of an in-process engine (or a core): put between the core and its
    runner on first use, the same one after."""
    core = engine if isinstance(engine, EngineCore) else core_of(engine)
    if not isinstance(core.runner, StepFaults):
        core.runner = StepFaults(core.runner)
    return core.runner
