"""`python -m kiln.train SPEC.json`: train (or resume) one lm_checkpoint step.

Multi-host: run the same command on every host with `--coordinator HOST:PORT --num-processes N
--process-id I` (process 0's host and a free port), or `--coordinator auto` where jax detects
the cluster itself (TPU pods, SLURM, ...). The processes form one jax runtime over all hosts'
devices (jax.distributed; gloo collectives between CPU hosts); process 0 writes the run's files.

Exit codes: 0 complete; 1 bad input or expected error (one-paragraph message, no traceback);
2 non-finite loss; 3 stopped early by runtime.max_steps_this_run (a checkpoint was saved: rerun
to continue); 128 + signal number when interrupted by SIGINT/SIGTERM (a checkpoint was saved).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln import lifetime  # before the slow imports: it notes the parent process
from kiln.train import multihost
from kiln.train.spec import SpecError, TrainSpec, load_spec

EXIT_STOPPED_EARLY = 3
# How long a trainer whose parent process died has to save a checkpoint before it is killed.
ORPHAN_GRACE_SECONDS = 30.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("spec", type=Path, help="the train spec JSON (docs/step-spec.md)")
    parser.add_argument(
        "--quiet", action="store_true", help="do not print the summary JSON (the caller reports)"
    )
    multihost.add_flags(parser)
    args = parser.parse_args(argv)
    lifetime.stop_when_orphaned(ORPHAN_GRACE_SECONDS)  # SIGTERM: a checkpoint, then exit
    cluster = multihost.cluster_from_flags(parser, args)
    from kiln.train import compilation_cache

    compilation_cache.use(None)  # $JAX_COMPILATION_CACHE_DIR's folder, for every program
    try:
        with multihost.joined(cluster):
            return run_training(load_spec(args.spec), quiet=args.quiet)
    except (SpecError, multihost.JoinError) as e:
        print(f"kiln.train: error: {e}", file=sys.stderr)
        return 1


def run_training(
    spec: TrainSpec,
    *,
    quiet: bool,
    metrics_observer: Callable[[Path], None] | None = None,
    start_from: Callable[..., Any] | None = None,
    on_stop: Callable[[str], None] | None = None,
) -> int:
    """Trains the run `spec` describes (on every process of a multi-host run); returns the exit
    code, with expected failures printed as one paragraph, which `on_stop` is also given when
    the run did not complete (the runner records it beside STATUS). `metrics_observer` and
    `start_from`: see kiln.train.trainer.MetricsObserver and StartFrom."""
    exit_code, message = _train(spec, quiet, metrics_observer, start_from)
    if message is not None:
        print(f"kiln.train: {message}", file=sys.stderr)
        if on_stop is not None:
            on_stop(message.removeprefix("error: "))
    return exit_code


def _train(
    spec: TrainSpec,
    quiet: bool,
    metrics_observer: Callable[[Path], None] | None,
    start_from: Callable[..., Any] | None,
) -> tuple[int, str | None]:
    """(exit code, the message of a run that did not complete)."""
    # Kiln's own notes at INFO; libraries (orbax/absl log every save at INFO) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln").setLevel(logging.INFO)
    # Heavy imports (jax) after argument parsing, so `--help` is instant.
    from kiln.data.errors import KilnDataError
    from kiln.data.mixture import MixtureError
    from kiln.train.trainer import TrainingError, TrainingInterrupted, train

    try:
        summary = train(spec, metrics_observer, start_from)
    except (KilnDataError, MixtureError) as e:
        return 1, f"error: {e}"
    except TrainingError as e:
        kind = "" if isinstance(e, TrainingInterrupted) else "error: "
        return e.exit_code, f"{kind}{e}"
    except KeyboardInterrupt:
        return 130, "interrupted before a checkpoint could be saved"
    if not quiet:
        print(json.dumps(summary, indent=2, sort_keys=True))
    if not summary["complete"]:
        return EXIT_STOPPED_EARLY, (
            f"stopped early at step {summary['step']} of {summary['num_train_steps']} "
            "(runtime.max_steps_this_run); rerun without it to finish"
        )
    return 0, None


if __name__ == "__main__":
    sys.exit(main())
