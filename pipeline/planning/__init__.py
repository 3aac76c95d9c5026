"""Planning a run before any training: the run's config as the workflow loads it (`run_config`, the
one entry point the Snakefile calls), the checks between the workflow and trainer configs
(`checks`), the stage schedule (`schedule`), a sweep's variants and its prune decisions (`sweep`),
the guard that keeps a changed config from retraining a finished run in place (`guard`), what each
kind of job asks a cluster for (`resources`), the run's data order (`order`), how each update's
records are packed into micro-batches (`packing`), and the `plan` command with its memory estimate
(`plan`). All but `plan` and `order` import no torch: the Snakefile uses them when it loads.
"""
