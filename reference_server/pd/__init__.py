"""Disaggregated prefill/decode serving: the router, the routes of a prefill or decode instance, and
the spans a single instance's request tree does not hold (KV transfer, KV receive, the router's)."""
