"""Does a training's step fit its TPU slice? Compiled ahead of time, on any machine.

`python -m kiln.fit STEP.json --vocab-size V [--target v4-128]` compiles the trainer's own step
(kiln.train.step.jit_train_step: its mesh, sharding, remat policy, microbatches and attention
kernel, from the step spec the runner trains from) for libtpu's mock devices of the slice, on
the CPU, and reads the executable's memory per chip: parameters and optimizer state,
temporaries, peak, against the chip's HBM as the compiler counts it. An executable that cannot
fit is refused by the compiler ("Ran out of memory on HBM"): that is "does not fit", with the
compiler's numbers. When it does not fit, it compiles the usual remedies (more microbatches,
stricter remat, other mesh splits) and names the first that fits.

`pants plan --fit` runs it as a cached process per training (kiln_pants.plan);
docs/fitting.md ("Fitting a run on its slice") describes the output and its limits.
"""
