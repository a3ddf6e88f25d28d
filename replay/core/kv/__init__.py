"""A replica's KV, part of the engine core: the manager (the only code that changes who holds which
blocks), the prefix cache and its hybrid (per layer group) form, real block names for a paged runner,
the offload tiers below GPU memory and KV retention across tool waits.
"""
