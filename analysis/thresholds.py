"""The diagnosis thresholds, in one place: `phaselens diagnose`, the report and the Grafana verdict
panel all render the same SQL (`phaselens.analysis.queries.diagnosis_causes`), which takes its
numbers from here. Every threshold is a ratio or a share, not a number of milliseconds: on a
contended machine every duration grows together, a share of TTFT much less.

Calibrated on real runs of the reference server (tiny model, 2 contended CPU cores, scenarios of
tests/test_diagnose.py); the figures quoted are what those runs measured.
"""

from __future__ import annotations

# the SLOs judged when the user gives none, declared in common/slo.py
from phaselens.common.slo import DEFAULT_TPOT_SLO_MS as DEFAULT_TPOT_SLO_MS
from phaselens.common.slo import DEFAULT_TTFT_SLO_MS as DEFAULT_TTFT_SLO_MS

# An SLO "holds with margin" at a percentile when the figure is at most MARGIN × SLO: a run at
# 90 % of its target is one burst away from missing it, so it still gets causes ("at risk").
MARGIN = 0.8
# A TTFT term is a cause at a percentile when its statistic is at least this share of TTFT's.
# Shares of percentiles do not add up to 1; 0.3 keeps the one or two terms that dominate (queue
# took 82–89 % of TTFT under overload, prefill 94 % of TTFT p50 with 1,900-token prompts) and leaves
# the loopback residual of steady runs out (1–25 %). Under a burst of simultaneous connections the
# server accepts and parses them before its `received` stamp, and the residual reached 50 %: that
# wait is outside the server's spans, so `network` then rightly contributes.
TERM_SHARE = 0.3
# Decode is a cause when the server's TPOT is at least this share of the client's (the rest is the
# client reading the stream: the `client` cause, with the same threshold on its share).
DECODE_SHARE = 0.5
CLIENT_SHARE = 0.3
# prefill_stalls: the share of decode-token time spent above a decode-only step in steps that also
# carried prefill (Σ decode_tokens × extra_ms / Σ decode_tokens × step_ms). Measured: 0.01–0.05 in
# healthy, overload and KV-bound runs with short prompts; 0.48 with prompts of up to ~2,400 tokens
# mixed into 12 decoding streams, 0.78 with 1,900-token prompts arriving at 2 req/s.
STALL_SHARE = 0.2
# kv_pressure: KV blocks in use at the 90th percentile of engine steps (near full: admission waits
# for blocks) or the share of requests preempted at least once. Measured KV p90: ≤ 0.27 without
# pressure, 0.94 with a 256-token cache (one sequence at a time, no preemption), 1.0 with a 512-token
# cache and 12 growing sequences (75 % of them preempted); any preemption means a sequence lost its
# KV and recomputed it.
KV_USED = 0.9
PREEMPTED_SHARE = 0.02
# Load dependence: the run is cut into LOAD_BUCKETS time buckets; the interior ones (the first and
# last are partial) differ enough to compare low and high load when the fastest bucket's arrival rate
# is at least RATE_SPREAD × the slowest's. Few, full buckets keep one Poisson rate under it: the demo
# (200 requests at 5 req/s) cut into 10 buckets with its edges spanned 1.6–6.0 req/s, a false
# "second rate"; 4 interior buckets of ~40 arrivals vary by about ±15 %. Queueing "grows with load"
# when the faster half's queue p50 is QUEUE_GROWTH × the slower half's.
LOAD_BUCKETS = 6
RATE_SPREAD = 2.0
MIN_BUCKET_REQUESTS = 5
QUEUE_GROWTH = 2.0
# Workload shape: prompt-heavy when input tokens are this many times the output tokens (p50s).
PROMPT_HEAVY = 4.0
# Prefix cache: a hit rate below this with prefill as a cause makes prompt reuse a lever worth checking.
PREFIX_HIT_LOW = 0.5
# Disaggregated serving: the KV transfer is a cause when it takes this share of client TTFT (p50 or p99).
KV_TRANSFER_SHARE = 0.15
