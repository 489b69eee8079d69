"""Integrations with inference servers phaselens does not own; each imports its server only inside
its own subpackage."""
