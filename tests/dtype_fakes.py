"""A fake `dtype: auto` probe that answers differently on each call, across processes (the noisy probe
of a loaded machine: one replica measured bfloat16 1.55x, the other 0.69x, in one run).

`install_alternating_probe()` patches `scissorhands.models` in the calling process (and, named as Ray's
``worker_process_setup_hook``, in every Ray worker): the CPU reports AVX512-BF16 without AMX (where the probe
decides; with AMX the flag alone does), and the probe's n-th call
anywhere (counted in the file ``$SCISSORHANDS_TEST_PROBE_COUNTER``) answers 2.0x when n is odd and 0.5x
when even, so two replicas that each probe run bfloat16 and float32.
"""

import os

COUNTER_ENV = "SCISSORHANDS_TEST_PROBE_COUNTER"


def probe_calls(path) -> int:
    """How many times the fake probe ran (all processes)."""
    return os.path.getsize(path) if os.path.exists(path) else 0


def install_alternating_probe() -> None:
    path = os.environ.get(COUNTER_ENV)
    if not path:
        return
    import scissorhands.models as models

    def probe(hidden: int, intermediate: int, threads: int) -> float:
        with open(path, "ab") as f:  # O_APPEND: one byte per call, whatever the process
            f.write(b"x")
        return 2.0 if probe_calls(path) % 2 else 0.5

    models.dtype.cpu_flags = lambda: frozenset({"avx512_bf16"})
    models.dtype.probe_bfloat16_speedup = probe
