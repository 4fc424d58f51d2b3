"""Workloads built on convoy's runtime and data plane: one subpackage each."""
