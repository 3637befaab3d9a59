"""Per-arm Prometheus metrics of the experiments (default registry, served at the gateway's /metrics).

    pdserve_experiment_requests_total{experiment,arm}    requests routed to the arm
    pdserve_experiment_errors_total{experiment,arm}      requests that failed on it
    pdserve_experiment_feedback_total{experiment,arm}    client feedback received
    pdserve_experiment_reward{experiment,arm}            mean reward so far (feedback included)
    pdserve_experiment_allocation{experiment,arm}        the policy's intended share of the next request
    pdserve_experiment_arm_up{experiment,arm}            1 while the arm's deployment has workers
    pdserve_experiment_ttft_seconds{experiment,arm}      time to first token (histogram)
    pdserve_experiment_tpot_seconds{experiment,arm}      time per output token after the first
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from gateway.observe import LATENCY_BUCKETS, TPOT_BUCKETS

LABELS = ("experiment", "arm")

REQUESTS = Counter("pdserve_experiment_requests", "Requests routed to an experiment's arm", LABELS)
ERRORS = Counter("pdserve_experiment_errors", "Requests that failed on an experiment's arm", LABELS)
FEEDBACK = Counter("pdserve_experiment_feedback", "Client feedback received for an experiment's arm", LABELS)
REWARD = Gauge("pdserve_experiment_reward", "Mean reward of an experiment's arm (feedback included)", LABELS)
ALLOCATION = Gauge("pdserve_experiment_allocation", "The policy's intended share of the next request", LABELS)
ARM_UP = Gauge("pdserve_experiment_arm_up", "1 while the arm's deployment has a healthy prefill and decode worker",
               LABELS)
TTFT = Histogram("pdserve_experiment_ttft_seconds", "Time to first token per experiment arm", LABELS,
                 buckets=LATENCY_BUCKETS)
TPOT = Histogram("pdserve_experiment_tpot_seconds", "Time per output token after the first, per experiment arm",
                 LABELS, buckets=TPOT_BUCKETS)
