"""Reinforcement learning as roles of one job: actors, a replay buffer and learners, scaled by the rates
they produce and consume (README.md here says how the data flows)."""
