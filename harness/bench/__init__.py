"""What the benchmarks share: starting the system, the machine, recording results."""
