"""The master's side of jobs of roles: membership as a pure state machine, placement, sizing,
the orders each agent is given, and the master's calls."""
