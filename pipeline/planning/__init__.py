"""Planning a run before any training: the stage schedule (`schedule`), the plan with its memory
estimate and the checks between the workflow and trainer configs (`plan`), a sweep's variants and
its prune decisions (`sweep`). `schedule` and `sweep` import no torch: the Snakefile uses them when
it loads.
"""
