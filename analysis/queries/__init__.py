"""Every analysis query, by name: the templates, the two renderings of one template (`dialect`: bound
parameters for the CLI, macros for Grafana), the rollups' quantile sketch (`sketch`), and ids as bound
parameters (`id_batches`)."""
