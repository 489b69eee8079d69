"""`phaselens diagnose`: the verdict (`diagnosis`), the figures it reads (`diagnose_figures`), the
levers that act on each cause (`levers`), the KV-transfer cause of disaggregated requests
(`pd_diagnose`), and the verdict as text (`diagnose_format`)."""
