"""Tensor parallelism: Megatron-style blocks whose weights are split over ranks (blocks.py); the pipeline
runs them to fill its bubbles (``pipeline/fill.py`` plans where)."""
