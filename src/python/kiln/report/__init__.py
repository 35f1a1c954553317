"""Reading a run's metrics back: training plots (plots.py) and the end-of-run table (table.py).

See docs/training-control.md for the files read and the figures shown.
"""
