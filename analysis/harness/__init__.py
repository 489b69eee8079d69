"""Another harness's per-request export as phaselens reads it (`harness_records`, `harness_formats`)
and imported as CLIENT spans into the traces of the requests it made (`harness_import`)."""

from phaselens.analysis.harness.harness_formats import read_export
from phaselens.analysis.harness.harness_import import distributed_cluster, import_run, summary_lines
from phaselens.analysis.harness.harness_records import HarnessFormatError

__all__ = ["HarnessFormatError", "distributed_cluster", "import_run", "read_export", "summary_lines"]
