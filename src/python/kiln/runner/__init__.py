"""`python -m kiln.runner STEP.json ...`: build one lm_checkpoint artifact, Marin's StepRunner for
one step, run by `pants run` (interactive) and `pants package` (a cached process).

The Pants backend has already built the input caches and placed them under `--inputs`. The
runner parses the step spec once, then, in the artifact store at `--prefix` (a directory, or a
bucket: every operation goes through kiln.artifacts.store's interface, so both take one path):

  1. decides (`decision`): already built with this fingerprint -> report and stop; built with
     another fingerprint -> refuse, naming the fields that differ (bump the version, or
     --force); otherwise:
  2. takes the artifact's lease and holds it until the end (`leasing`): while another run holds
     it, this one waits, saying who builds it and how far it is, then serves its result;
     --no-wait refuses at once. With --force the built artifact is set aside (`replacing`) and
     deleted only once the rebuild succeeds;
  3. places each input cache in the store at `{name}/{version}` (`inputs`: verified against
     the cache's digests, STATUS last);
  4. writes STATUS RUNNING and the record with provenance, trains in its `workspace` (the
     artifact's folder in a directory; a staging folder mirrored into a bucket), resuming from
     the newest checkpoint, and writes STATUS last: SUCCESS, or FAILED when anything fails
     (`training`).
With a cluster (`--cluster`, `cluster`), steps 1 and 3 run here and the rest on the cluster's
hosts, each running this runner as one process of a multi-host run.

A code-only change does not retrain a finished artifact: the record keeps the code digest it was
built with, and a differing one is reported ("built by other code"), never silently discarded.

Exit status: 0 built or served; 1 an expected error (one paragraph: bad input, a damaged input
cache, a lease held by another run with --no-wait, a run waited for that failed); 2 the loss
diverged; 3 stopped early by --max-steps (rerun to continue); 4 a storage error, as one line
`kiln: error: PATH: CAUSE` (no space, no permission, an I/O error, an unreachable bucket: fix it
and rerun, the run resumes); 128 + N stopped by signal N.

Containment: before anything is written, the output, the checkpoint folders and each input it
places are resolved and checked to lie in the prefix (or the explicit --output folder), and a
dev rerun deletes only its own artifact's checkpoints (kiln.containment). SIGTERM stops a run as
Ctrl-C does, and the runner stops when the Pants process that started it dies (kiln.lifetime).

Multi-host (`--coordinator ...`, the same command on every host, docs/training.md): every process
serves or refuses alike and derives the same train spec; process 0 alone places the inputs, holds
the lease and writes STATUS and the record; then all train and compute the report (both
collectives), and process 0 writes it.
"""
