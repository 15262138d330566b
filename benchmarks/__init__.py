"""flexattn's benchmarks: each suite times flexattn against its competitors and writes JSON results.

    python -m benchmarks                       # every suite at the default shapes (CUDA GPU)
    python -m benchmarks attention decode      # some suites
    python -m benchmarks report                # docs/performance.md and its plots from the results

See ``python -m benchmarks --help`` and docs/performance.md.
"""
