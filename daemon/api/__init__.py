"""HTTP endpoints of the daemon, one module per audience."""
