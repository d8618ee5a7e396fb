"""`--dist loadscope` that survives a crashed worker (a pytest plugin; tests/conftest.py
registers it).

NOTE: pytest-xdist 3.8.0's LoadScopeScheduling puts a crashed worker's whole workload back
on the queue, the modules it had finished included (pytest-xdist issue #1378). Each
finished module is later sent to a worker as an empty unit, which never reports back, so
the run stalls at its end until CI kills it: one crashed worker cost a 90-minute timeout
instead of one failed test. Here a crashed worker's finished modules are dropped and the
test it crashed on is marked done (xdist has reported it failed already; run again, it
would take the replacement worker down too), so the rest of its module goes to another
worker and the run ends with the crash in its summary. A send to a worker that died but
whose death xdist has not yet processed (its pipe broken: an INTERNALERROR that ended the
whole run) is dropped: the work it carried stays assigned to that worker, and goes back on
the queue when xdist removes the worker.

With CRASHED_TESTS_FILE set, each test a worker died on is also appended to that file:
`make test` then runs the failed tests once more (a worker killed from outside, which no
test can cause or prevent, must not fail CI alone; a test that fails again still does).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

CRASHED_TESTS_FILE = "CRASHED_TESTS_FILE"


class CrashSafeLoadScopeScheduling(LoadScopeScheduling):
    def remove_node(self, node: Any) -> str | None:
        """The node is gone: its unfinished tests, less the one it crashed on, go back on
        the queue; that one (None after a clean shutdown) is returned for xdist to report."""
        workload = self.assigned_work.pop(node)
        pending = [(scope, nodeid) for scope, unit in workload.items()
                   for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        scope, crashitem = pending[0]
        workload[scope][crashitem] = True
        self.workqueue.update(
            (scope, unit) for scope, unit in workload.items() if not all(unit.values())
        )
        for other in self.assigned_work:
            self._reschedule(other)
        if log := os.environ.get(CRASHED_TESTS_FILE):
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                f.write(crashitem + "\n")
        return crashitem

    def _reschedule(self, node: Any) -> None:
        """As xdist's, and a node is never left holding a single test (a worker waits for a
        next one before running it: a replacement worker given a one-test module would
        wait for ever); once the queue is empty every node is told to finish."""
        if node.shutting_down:
            return
        try:
            if self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)
        except OSError:
            return  # the worker died: remove_node requeues what it was given
        if not self.workqueue:
            for each in self.nodes:
                if not each.shutting_down:
                    try:
                        each.shutdown()
                    except OSError:
                        pass  # a dead worker needs no telling


def pytest_xdist_make_scheduler(config: Any, log: Any) -> LoadScopeScheduling | None:
    """`--dist loadscope` gets the crash-safe scheduler; other modes keep xdist's."""
    if config.getvalue("dist") == "loadscope":
        return CrashSafeLoadScopeScheduling(config, log)
    return None
