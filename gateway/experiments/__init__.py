"""A/B experiments between model variants (arms) by multi-armed bandit; not wired into the gateway yet.

Modules, one concept each:
- `policies`: allocation policies (fixed split, epsilon-greedy, UCB1, Thompson) with warm-up and a
  minimum share per arm.
- `assignment`: sticky session -> arm assignment, and moving sessions off an arm that goes down.
- `rewards`: the reward of one request in [0, 1] from SLOs, errors and client feedback.
- `config`: experiment configuration from TOML, validated with one-line errors naming the field.
See docs/experiments.md.
"""
