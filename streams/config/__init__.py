"""Configuration: the environment (`settings`), durations, and the two YAML files —
`topics` (topics.yaml, the topic registry) and `queues` (queues.yaml, each queue's
extensions and knobs) — validated by pydantic models built on `fields`.

`settings`, `durations` and `fields` are the foundation every layer may use (the
extensions too); `topics` and `queues` sit above the extensions, whose kinds they list.
"""
