"""What a process that submits work to a Ray cluster ships to the nodes
(kiln.cluster.runtime_shipping): the Pants backend names the files, in the process's sandbox, in
these environment variables."""

RUNTIME_PEX_VARIABLE = "KILN_RUNTIME_PEX"  # the packed runtime PEX folder Pants built
PLUGIN_LOCK_VARIABLE = "KILN_PLUGIN_LOCK"  # the accelerator plugin's lockfile
