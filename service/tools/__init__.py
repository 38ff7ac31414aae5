"""Tools that drive a running Cadenza server from the outside (load generation)."""
