"""`phaselens diagnose`: the verdict (`diagnosis`), the figures it reads (`diagnose_figures`), the
levers that act on each cause (`levers`), the KV-transfer cause of disaggregated requests
(`pd_diagnose`), and the verdict as text (`diagnose_format`)."""

from phaselens.analysis.diagnose import diagnose_format
from phaselens.analysis.diagnose.diagnosis import Diagnosis, diagnose

__all__ = ["Diagnosis", "diagnose", "diagnose_format"]
