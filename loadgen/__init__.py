"""The client harness: arrival processes, workloads, the async runner, run-level metrics (goodput,
failure-adjusted tails, latency from the intended send time), capacity sweep and reports.
Every request goes through `phaselens.instrumentation.client.TracedClient`, so each one is a CLIENT span."""
