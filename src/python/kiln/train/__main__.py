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

EXIT_STOPPED_EARLY = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.train", description=__doc__.split("\n")[0]
    )
    parser.add_argument("spec", help="the step spec JSON (docs/step-spec.md)")
    parser.add_argument(
        "--quiet", action="store_true", help="do not print the summary JSON (the caller reports)"
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT|auto",
        help="multi-host: process 0's address (every process gives the same), or auto",
    )
    parser.add_argument("--num-processes", type=int, help="multi-host: how many processes")
    parser.add_argument("--process-id", type=int, help="multi-host: this process, 0-based")
    args = parser.parse_args(argv)
    explicit = (args.num_processes, args.process_id)
    if args.coordinator not in (None, "auto") and None in explicit:
        parser.error("--coordinator HOST:PORT needs --num-processes and --process-id")
    if args.coordinator in (None, "auto") and explicit != (None, None):
        parser.error("--num-processes and --process-id go with --coordinator HOST:PORT")
    # Kiln's own notes at INFO; libraries (orbax/absl log every save at INFO) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kiln").setLevel(logging.INFO)
    # Heavy imports (jax) after argument parsing, so `--help` is instant.
    from kiln.data.errors import KilnDataError
    from kiln.data.mixture import MixtureError
    from kiln.train.spec import SpecError, load_spec
    from kiln.train.trainer import TrainingError, TrainingInterrupted, train

    try:
        distributed = _start_distributed(args)
    except (ValueError, RuntimeError) as e:  # no cluster found, coordinator unreachable, ...
        print(
            f"kiln.train: error: cannot join the multi-host run ({str(e).splitlines()[0]}); "
            "give --coordinator HOST:PORT --num-processes N --process-id I, or run --coordinator "
            "auto where jax can detect the cluster (TPU pods, SLURM)",
            file=sys.stderr,
        )
        return 1
    try:
        summary = train(load_spec(args.spec))
    except (SpecError, KilnDataError, MixtureError) as e:
        print(f"kiln.train: error: {e}", file=sys.stderr)
        return 1
    except TrainingError as e:
        kind = "" if isinstance(e, TrainingInterrupted) else "error: "
        print(f"kiln.train: {kind}{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("kiln.train: interrupted before a checkpoint could be saved", file=sys.stderr)
        return 130
    finally:
        if distributed:  # every process leaves together: none tears down a collective in use
            import jax

            jax.distributed.shutdown()
    if not args.quiet:
        print(json.dumps(summary, indent=2, sort_keys=True))
    if not summary["complete"]:
        print(
            f"kiln.train: stopped early at step {summary['step']} of {summary['num_train_steps']} "
            "(runtime.max_steps_this_run); rerun without it to finish",
            file=sys.stderr,
        )
        return EXIT_STOPPED_EARLY
    return 0


def _start_distributed(args: argparse.Namespace) -> bool:
    """Joins the multi-process jax runtime when --coordinator is given; True if it did."""
    if args.coordinator is None:
        return False
    import jax

    # CPU hosts need a collectives backend across processes; GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    return True


if __name__ == "__main__":
    sys.exit(main())
