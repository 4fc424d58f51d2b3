"""Confidential shared learning: providers attest an enclave, send it encrypted rows or local models, and
each gets the shared model back encrypted for it alone. See README.md for what is real and what is simulated."""
