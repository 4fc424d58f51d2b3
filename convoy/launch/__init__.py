"""What starts a job's processes: the local launcher (a master and N agents as child processes), the
endpoint launcher of several hosts, and the schedulers that place agents."""
