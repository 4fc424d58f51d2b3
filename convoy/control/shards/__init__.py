"""Dynamic data shards: the queue of a dataset's shards and the master's side of it."""
