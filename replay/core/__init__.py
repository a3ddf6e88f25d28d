"""The engine core, the bottom layer of replay/: the event loop (`engine`), the request and its queues,
a replica's state, a policy's batch and the budget keeper, the step in flight and request progress, the
contracts the engine calls (`protocols`), the intents the layers above return, the journal and the logs,
the engine's config, and the per-request features the loop runs (LoRA, encoders, speculative decoding,
dependencies). KV lives in `core/kv/`.

The core imports nothing from the cluster, the platform or the assembly (tests/test_layers.py).
"""
