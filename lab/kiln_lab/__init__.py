"""Kiln's kernel lab: experimental attention kernels and the tools that tune and compile them.

The lab imports the product (kiln.kernels); the product never imports the lab, so nothing here
is in the runtime's code closure or changes a checkpoint's code digest.
"""
