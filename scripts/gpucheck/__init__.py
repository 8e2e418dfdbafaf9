"""The stages of scripts/gpu_check.py: `fixtures` (shapes, synthetic data, random models, configs),
`measure` (step meter, matmul peak, profiler sync counts, the row and its table), `stages` (one
function per stage, each returning rows)."""
