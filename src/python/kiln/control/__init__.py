"""Training control: a capability-token-protected HTTP endpoint served by training process 0.

See docs/training-control.md. The trainer uses kiln.control.server.ControlServer; operators mint
fresh URLs with `python -m kiln.control mint RUN_DIR`.
"""
