"""Sequence parallelism: attention over a sequence sharded across ranks by broadcasting queries
(query_broadcast.py plans it, query_stream.py streams it in chunks), the peers' schemes it is measured
against (baselines.py: ring, Ulysses, all-gather of keys and values), and the blockwise attention math both
use (attention.py)."""
