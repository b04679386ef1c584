"""Running a model: the runtime (a loaded model), the session (one conversation's prefill and
decode), one decode step's attention fan-out (step.py), CUDA graphs, the batching engine,
sampling, chat, .kvc files, the command line's option groups, progress and the stats line."""
