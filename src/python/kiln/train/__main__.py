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
import sys
from pathlib import Path

from kiln import lifetime  # before the slow imports: it notes the parent process
from kiln.train import multihost, progress
from kiln.train.spec import SpecError, TrainSpec, load_spec

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
    group = multihost.process_group_from_flags(parser, args)
    from kiln.train import compilation_cache

    compilation_cache.use(None)  # $JAX_COMPILATION_CACHE_DIR's folder, for every program
    try:
        with multihost.joined(group):
            return run_training(load_spec(args.spec), quiet=args.quiet)
    except (SpecError, multihost.JoinError) as e:
        print(f"kiln.train: error: {e}", file=sys.stderr)
        return 1


def run_training(spec: TrainSpec, *, quiet: bool) -> int:
    """Trains the run `spec` describes (on every process of a multi-host run); returns the exit
    code, with a run that did not complete said in one paragraph."""
    progress.configure_logging()
    # Heavy imports (jax) after argument parsing, so `--help` is instant.
    from kiln.train.errors import TrainingError, TrainingStopped
    from kiln.train.trainer import train_to_end

    try:
        finished = train_to_end(spec)
    except (TrainingError, TrainingStopped) as e:
        print(e.line, file=sys.stderr)
        return e.exit_code
    if not quiet:
        print(json.dumps(finished.summary, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    with multihost.exiting():
        sys.exit(main())
