"""Scripts that run inside each anchor engine's own venv (never imported by tokenmill).

They read a workload JSON of token ids and write a result JSON; `runner_io` is what they share.
"""
