"""What a training script calls that is not torch: its role, status reports, the live config, data
shards, the measuring iteration, events, and the round lease. Torch-free."""
