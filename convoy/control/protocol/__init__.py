"""The one contract of the control plane: the wire messages between workers, agents and the master,
and the master's client."""
