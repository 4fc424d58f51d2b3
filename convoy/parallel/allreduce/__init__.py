"""Allreduce: hierarchical algorithms and their calls (collectives.py), the checks of a call (agree.py), the
measured choice among the algorithms (autotune.py), shared-memory phases inside a node (host_memory.py), the
DDP hook thread's own groups (lanes.py), and the coded crossing between nodes (float_codec.py)."""
