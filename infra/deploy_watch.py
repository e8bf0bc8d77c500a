"""``thaw deploy``'s view of a deploy job: a progress bar per stage until the job has finished.

The controller runs a deploy as a job (`controller.DeployJobs`); the CLI starts it, then long-polls
``GET /admin/deploys/{id}?wait_s=`` and draws what each record says with tqdm (the library the
simulator's progress bar already uses): one bar per stage that moves bytes (converting,
uploading; checking when unchanged content is hashed), with its rate and ETA, and a plain line
for the stages that do not (registering). A long poll answers as soon as the job ends, so a small
deploy costs one round trip; a large one redraws about once a second.

While the controller does not answer (503: Ray is restarting it) the watch keeps asking, up to
`UNAVAILABLE_S`; a job the restarted controller no longer knows (nothing of the deploy is
visible) is `DeployLost`, whose message says to run the deploy again.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, TextIO

from tqdm import tqdm

from infra.admin_client import AdminApiError, AdminClient
from wire import DeployProgress, DeployStage, DeployState

__all__ = ["DeployLost", "DeployProgressView", "watch_deploy"]

POLL_S = 1.0  # each long poll's bound: how often a running job's bar is redrawn
UNAVAILABLE_S = 120.0  # how long the watch waits for a controller that does not answer


class DeployLost(Exception):
    """The controller forgot the job (restarted): the deploy left nothing visible and can be run again."""


class DeployProgressView:
    """Draws successive records of one job on `out` (see the module docstring)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out if out is not None else sys.stderr
        self._stage: DeployStage | None = None
        self._bar: Any = None

    def show(self, record: DeployProgress) -> None:
        if record.stage is not self._stage:
            if self._bar is not None and record.state is not DeployState.FAILED:  # a stage moved past is done
                self._bar.update(max(0, self._bar.total - self._bar.n))
            self._close_bar()
            self._stage = record.stage
            if record.stage is DeployStage.DONE:
                return
            if record.num_bytes_total > 0:
                self._bar = tqdm(total=record.num_bytes_total, desc=f"  {record.stage.value}", unit="B",
                                 unit_scale=True, unit_divisor=1024, file=self._out, leave=True,
                                 dynamic_ncols=True)
            else:
                print(f"  {record.stage.value} ...", file=self._out, flush=True)
        if self._bar is not None:
            if record.num_bytes_total and record.num_bytes_total != self._bar.total:
                self._bar.total = record.num_bytes_total
            self._bar.update(max(0, record.num_bytes_done - self._bar.n))

    def close(self) -> None:
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


async def watch_deploy(client: AdminClient, record: DeployProgress, view: DeployProgressView | None = None
                       ) -> DeployProgress:
    """Follows the job until it finished; returns its last record (succeeded or failed)."""
    loop = asyncio.get_running_loop()
    unavailable_since: float | None = None
    try:
        while True:
            if view is not None:
                view.show(record)
            if record.finished:
                return record
            try:
                record = await client.deploy_status(record.deploy_id, wait_s=POLL_S)
                unavailable_since = None
            except AdminApiError as exc:
                if exc.status == 503:  # the controller is restarting: ask again, for a while
                    unavailable_since = unavailable_since or loop.time()
                    if loop.time() - unavailable_since > UNAVAILABLE_S:
                        raise
                    await asyncio.sleep(POLL_S)  # a retry interval, bounded above
                    continue
                if exc.status == 404:
                    raise DeployLost(f"the controller no longer knows deploy {record.deploy_id} (it was restarted "
                                     f"while deploying {record.model_id}); nothing of that deploy is visible: run "
                                     f"it again") from None
                raise
    finally:
        if view is not None:
            view.close()
