"""Training, and tokenizing store-mode caches, on a Ray cluster (docs/clusters.md).

`placement` turns a step's `resources` into a placement group and checks it against the cluster's
nodes (no Ray needed); `jobs` submits a run as a job and follows, lists, shows and stops jobs
(`python -m kiln.cluster`, `./pants run :kiln-cluster`); the job is a `driver.JobDriver` actor,
which runs the hosts through `dispatch`; `host` is the Ray actor each host runs; `endpoints`
finds, lists and mints for the run's control endpoint on process 0's host. `runtime_shipping`
sends Kiln's runtime to the nodes, and `node_runtime` fetches and runs it there. `fanout`
tokenizes a store-mode cache's shards as Ray tasks (`python -m kiln.cluster.fanout`), each one a
`tokenize_task`. `driver`, `host`, `node_runtime` and `tokenize_task` are standard library only
at import (and Ray): they are shipped by value.
"""
