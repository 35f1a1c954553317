"""A small real training loop driving ControlServer, run as a subprocess by a test.

Usage: python toy_training_loop.py RUN_DIR NUM_STEPS STEP_SECONDS

Each "step" does a little numpy work, reports progress and, when the endpoint asked for one,
writes RUN_DIR/checkpoints/step-N/metadata.json the way the trainer marks a finished save. Prints
the capability URL first, as the trainer does, then one line per save.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

from kiln.artifacts.atomic import atomic_write_json
from kiln.control.server import ControlServer


def main(run_dir: Path, num_steps: int, step_seconds: float) -> None:
    # Like the trainer: SIGTERM unwinds normally, so stop() runs and removes the key.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = ControlServer(run_dir, {"run_id": "toy", "name": "toy", "version": "1"}, {})
    print(server.start(), flush=True)
    weights = np.zeros(16)
    try:
        for step in range(1, num_steps + 1):
            weights -= 0.1 * (weights - 1.0)
            time.sleep(step_seconds)
            loss = float(np.sum((weights - 1.0) ** 2))
            server.update(step=step, total_steps=num_steps, loss=loss)
            if server.take_checkpoint_request():
                checkpoint = run_dir / "checkpoints" / f"step-{step}"
                atomic_write_json(checkpoint / "metadata.json", {"step": step, "loss": loss})
                print(json.dumps({"saved": step}), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
