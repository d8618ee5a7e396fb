"""Attention backends: the interface (backend.py), one module per backend (torch_backend,
the reference; cpu_backend; triton_backend) and the choice among them (selection.py)."""
