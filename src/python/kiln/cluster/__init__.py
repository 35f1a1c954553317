"""Training on a Ray cluster (docs/clusters.md).

`placement` turns a step's `resources` into a placement group and checks it against the cluster's
nodes (no Ray needed); `dispatch` connects to the cluster and runs one trainer process per host;
`host` is the Ray actor each host runs (standard library only: it is shipped by value).
"""
