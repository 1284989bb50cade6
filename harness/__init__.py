"""What tests and benchmarks share: the system started as processes, workloads,
the history checker, faults, waiting for a condition."""
