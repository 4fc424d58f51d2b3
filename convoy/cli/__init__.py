"""The commands: ``convoy run | master | agent | status | scale | config | manager | dashboard | ...``."""
