"""Budget rollups: per minute, -State aggregates of every budget term (`rollup`) and of the engine
steps (`step_rollup`), a complete copy on every node of a cluster (`rollup_copies`), recomputing
sealed minutes (`rollup_backfill`, `step_backfill`) and the one-time upgrade (`rollup_upgrade`)."""

from phaselens.analysis.rollup import rollup
from phaselens.analysis.rollup.rollup_backfill import BackfillError, backfill_minutes, minutes_between, on_each_node
from phaselens.analysis.rollup.rollup_upgrade import push
from phaselens.analysis.rollup.step_backfill import backfill_steps

__all__ = ["BackfillError", "backfill_minutes", "backfill_steps", "minutes_between", "on_each_node", "push", "rollup"]
