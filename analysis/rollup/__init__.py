"""Budget rollups: per minute, -State aggregates of every budget term (`rollup`) and of the engine
steps (`step_rollup`), a complete copy on every node of a cluster (`rollup_copies`), recomputing
sealed minutes (`rollup_backfill`, `step_backfill`) and the one-time upgrade (`rollup_upgrade`)."""
