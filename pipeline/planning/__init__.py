"""Planning a run before any training: the stage schedule (`schedule`), the plan with its memory
estimate and the checks between the workflow and trainer configs (`plan`), a sweep's variants and
its prune decisions (`sweep`), the guard that keeps a changed config from retraining a finished run
in place (`guard`), what each kind of job asks a cluster for (`resources`), the run's data order
(`order`) and how each update's records are packed into micro-batches (`packing`). `schedule`, `sweep`,
`guard` and `resources` import no torch: the Snakefile uses them when it loads.
"""
