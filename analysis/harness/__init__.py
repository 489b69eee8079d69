"""Another harness's per-request export as phaselens reads it (`harness_records`, `harness_formats`)
and imported as CLIENT spans into the traces of the requests it made (`harness_import`)."""
