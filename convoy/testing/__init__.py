"""Tools for testing convoy on one machine: network namespaces as hosts."""
