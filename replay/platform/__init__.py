"""The platform layer, built on the engine core beside the cluster: the front door (`admission`: quotas,
concurrency caps, retries, queue cap, pausing), the hooks the engine calls (`hooks`: front door, tier
pausing, shedding, replica failures), client timeouts (`abort`) and online mode (`online`).
"""
