"""The data plane: collectives, pipeline schedules, sequence parallelism, local SGD, sharded embeddings."""
