"""The training-control endpoint (kiln.control.server, docs/training-control.md) as one of the
loop's hooks: started on process 0 when runtime.control enables it, told the run's progress at
each sync point, and asked there whether a save was requested."""

from __future__ import annotations

import logging
from typing import Any

from kiln.train.hooks import SyncPoint
from kiln.train.metrics import MetricsLogger
from kiln.train.progress import Progress
from kiln.train.saves import Saves
from kiln.train.setup import TrainerSetup
from kiln.train.step_log import StepLog

log = logging.getLogger(__name__)


class ControlHook:
    def __init__(self, server: Any, setup: TrainerSetup, metrics: MetricsLogger, steps: StepLog,
                 saves: Saves):  # fmt: skip
        self.server = server  # kiln.control.server.ControlServer
        self.setup = setup
        self.metrics = metrics
        self.steps = steps
        self.saves = saves

    @classmethod
    def start(cls, setup: TrainerSetup, progress: Progress, metrics: MetricsLogger,
              steps: StepLog, saves: Saves) -> ControlHook | None:  # fmt: skip
        """The started endpoint, or None where it is off: disabled, not process 0, or (a
        warning) its package missing or no socket to listen on."""
        import jax

        control, spec = setup.runtime.control, setup.spec
        if not (control.enabled and jax.process_index() == 0):
            return None
        try:
            from kiln.control.server import ControlServer
        except ImportError as e:
            log.warning("training control endpoint unavailable (%s); continuing without it", e)
            return None
        server = ControlServer(
            spec.output_path,
            {"run_id": setup.wandb.run_id, "name": spec.name, "version": spec.version,
             "fingerprint": spec.fingerprint, "output_path": str(spec.output_path)},
            setup.resolved_config(),
            host=control.host,
            port=control.port,
            token_ttl_minutes=control.token_ttl_minutes,
        )  # fmt: skip
        try:
            url = server.start()
        except OSError as e:  # a port taken, or a machine that allows no sockets
            log.warning("training control endpoint cannot listen (%s); continuing without it", e)
            return None
        progress.message(f"training control: {url}")
        return cls(server, setup, metrics, steps, saves)

    def take_checkpoint_request(self) -> bool:
        return self.server.take_checkpoint_request()

    def __call__(self, point: SyncPoint) -> None:
        total, last = self.setup.cfg.num_train_steps, self.saves.last
        self.server.update(
            step=point.step, total_steps=total,
            loss=self.metrics.latest.get("train/loss"),
            tokens_per_second=self.metrics.latest.get("throughput/tokens_per_second"),
            eta_seconds=self.steps.eta_seconds(total - point.step),
            last_checkpoint=self.setup.spec.shown(last.path) if last else None,
        )  # fmt: skip

    def stop(self) -> None:
        self.server.stop()
