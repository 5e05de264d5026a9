"""Host integration: CPUs, GPUs, systemd, signals, metrics."""
