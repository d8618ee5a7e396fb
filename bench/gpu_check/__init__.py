"""The one prepared device check for a CUDA session; run it as `python -m bench.gpu_check`
(bench/gpu_check/__main__.py says what it checks)."""
