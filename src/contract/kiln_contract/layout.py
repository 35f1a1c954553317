"""An artifact folder's own files and status tokens (docs/artifacts.md): the names both halves
read and write, defined once.

    {prefix}/{name}/{version}/
        artifact.json     the record (kiln_contract.record), with provenance
        summary.txt       what `pants run` prints for a built artifact
        train_spec.json   a checkpoint's trainer spec (docs/step-spec.md)
        config.json       a checkpoint's resolved run config, written when the run starts
        summary.json      a checkpoint's last metrics, speed and where things are
        results.json      an evaluation's scores (lm_eval_run): {"model", "metrics"}
        failure.txt       why the last build failed (one line), beside STATUS FAILED
        STATUS            written last: SUCCESS, FAILED, RUNNING or DEP_FAILED
"""

RECORD_FILE = "artifact.json"
SUMMARY_TEXT_FILE = "summary.txt"  # a built artifact's human summary, printed when it is served
TRAIN_SPEC_FILE = "train_spec.json"
RUN_CONFIG_FILE = "config.json"
RUN_SUMMARY_FILE = "summary.json"
EVAL_RESULTS_FILE = "results.json"
FAILURE_FILE = "failure.txt"
STATUS_FILE = "STATUS"

SUCCESS = "SUCCESS"
FAILED = "FAILED"
RUNNING = "RUNNING"
# Written by `pants build` when an input of the artifact failed: Marin's status token for "not
# built because of a dependency"; the artifact runs again next time.
DEP_FAILED = "DEP_FAILED"

# Beside an artifact's folder `{name}/{version}/`, never in it: `.{version}.{SIBLING}`.
LEASE_SIBLING = "lease"  # the object of its builder's lease (kiln.artifacts.lease)
REPLACED_SIBLING = "replaced"  # the folder a forced rebuild sets aside (kiln.artifacts.replacement)
SHARDS_SIBLING = "shards"  # a local store-mode cache's shards while it builds
HOLDS_SIBLING = "holds"  # the holds of runs that need the artifact kept (kiln.artifacts.holds)
SIBLINGS = (LEASE_SIBLING, REPLACED_SIBLING, SHARDS_SIBLING, HOLDS_SIBLING)


def sibling_key(folder: str, sibling: str) -> str:
    """('tokenized/x/v1', 'lease') -> 'tokenized/x/.v1.lease': a key or path beside a folder."""
    parent, _, version = folder.rstrip("/").rpartition("/")
    name = f".{version}.{sibling}"
    return f"{parent}/{name}" if parent else name
