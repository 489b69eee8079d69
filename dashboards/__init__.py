"""Grafana dashboards for phaselens, generated from one Python source (`definitions`), their
provisioning files, and `push` to a running Grafana. Panel SQL comes from `phaselens.analysis.queries`."""
