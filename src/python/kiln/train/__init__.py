"""Training: the step spec, the loop, checkpoints, metrics and the train math (step.py)."""
