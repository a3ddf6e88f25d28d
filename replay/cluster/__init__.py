"""The cluster layer, built on the engine core: pools of replicas (`config`: the ``[cluster]`` table),
the prefill/decode handoff and the links that carry KV, the encode pool, autoscaling, instance types and
fleets of them. It reaches the core through its verbs and intents; it does not import the platform.
"""
