# BUILD-file macros ([GLOBAL] build_file_prelude_globs): read like a BUILD file, with its symbols.


def default_sft(name, base, model, datasets, num_train_steps, learning_rate, warmup=2, **fields):
    """Marin's `default_sft` as an `lm_checkpoint`: `base`'s weights (a fresh optimizer, the SFT
    mixture `datasets` read from its beginning) trained for `num_train_steps`, the learning rate
    warming up over `warmup` steps, then falling linearly to zero. `model` is the base's (the
    weights are its shape); every other field is `lm_checkpoint`'s (validation, batch_size, ...)."""
    lm_checkpoint(  # noqa: F821 - a BUILD file's symbol
        name=name,
        model=model,
        optimizer=adam(  # noqa: F821
            learning_rate=learning_rate, warmup=warmup, lr_schedule="linear", min_lr_ratio=0.0
        ),
        datasets=datasets,
        num_train_steps=num_train_steps,
        init_from=from_checkpoint(  # noqa: F821
            base, optimizer_state=False, reset_data_loader_on_init=True
        ),
        **fields,
    )
