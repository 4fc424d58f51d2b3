"""Parameter servers: placement (pure: which server holds what), the server's shard and optimizer, the worker's
client, and the transport between them (a socket protocol, picked by benchmarks/ps_transport.py)."""
