"""Running models: IREE and eager sessions, page allocation, the generate loop. Only the eager
session (eager.py) needs torch; running a compiled module loads neither torch nor IREE's compiler."""
