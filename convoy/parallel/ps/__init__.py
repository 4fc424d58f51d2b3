"""Parameter servers: placement (pure: which server holds what), the server's shard and optimizer, the worker's
client, and the request loop between them, on the role services' authenticated transport (convoy/parallel/transport/,
measured against torch RPC and gloo point-to-point by benchmarks/ps_transport.py; README.md here says why it stays)."""
