"""KV layer groups of a hybrid model (sliding-window, full and state layers), laid out as vLLM's hybrid KV cache manager does.

A model whose layers do not all attend the same way (Gemma 2/3 and gpt-oss interleave sliding-window
and full attention; Qwen3-Next, Jamba and Nemotron-H interleave linear-attention or state-space
layers with full attention) keeps one KV *group* per set of alike layers, all drawing pages from one
pool (vLLM v1 ``kv_cache_utils._get_kv_cache_groups_uniform_page_size``):

- layers of one kind are split into groups of ``group_size`` layers: the fewest layers of any kind,
  or the most when that is within 1.25 times the fewest; a kind whose count is not a multiple of it
  pads its last group (the padding layers' memory is allocated and unused);
- a pool *block* is one page in each of ``group_size`` layer tensors, so the pool has
  ``available bytes // (page bytes x group_size)`` blocks and a request holds blocks in every group;
- a full-attention group holds ``ceil(tokens / block_size)`` blocks per request; a sliding-window
  group frees the blocks whose tokens have all left the window before each step
  (``SlidingWindowManager.remove_skipped_blocks``): while computing ``n`` tokens on top of ``c`` it
  holds ``ceil((c + n) / block_size) - floor(max(0, c - window + 1) / block_size)``, which for a
  decode is at most ``ceil(window / block_size) + 1``; a state group (linear attention, Mamba) holds
  one block per request: its fixed state, which must fit one page (vLLM raises the attention block
  size until a page holds a state; here the engine's ``block_size`` must already be that large).

A model whose layers all attend the same way has no layout (``None``): the KV manager's own
``ceil(tokens / block_size)`` is then the whole story, at no cost.
"""

from __future__ import annotations

from dataclasses import dataclass

# How much larger than the fewest a kind's layer count may be for vLLM to use it as the group size.
GROUP_SIZE_SLACK = 1.25
# vLLM rounds the raised attention block size of a hybrid state model to a multiple of this
STATE_BLOCK_ALIGNMENT = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class LayerKinds:
    """How many layers of each kind one engine holds, and each kind's bytes on one GPU.

    ``token_bytes``: KV bytes of one token in one attention layer on one GPU (a TP shard, or MLA's
    whole latent); ``state_bytes``: one state layer's state for one sequence on one GPU."""

    full: int
    sliding: int
    state: int
    window: int  # tokens a sliding-window layer attends to (its own included); 0 without sliding layers
    token_bytes: int
    state_bytes: int = 0

    def __post_init__(self) -> None:
        if min(self.full, self.sliding, self.state) < 0 or self.full + self.sliding + self.state < 1:
            raise ValueError(f"layer counts must be >= 0 and add up to >= 1 (full {self.full}, sliding "
                             f"{self.sliding}, state {self.state})")
        if self.sliding and self.window < 1:
            raise ValueError(f"sliding-window layers need a window >= 1 token, got {self.window}")
        if self.state and self.state_bytes < 1:
            raise ValueError("state layers need their state's bytes per sequence (state_bytes)")

    def group_size(self) -> int:
        counts = [n for n in (self.full, self.sliding, self.state) if n]
        fewest, most = min(counts), max(counts)
        return most if most < fewest * GROUP_SIZE_SLACK else fewest


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The groups of one engine's KV pool and the blocks a request holds in them (all in pool blocks)."""

    kinds: LayerKinds
    block_size: int  # tokens per block of an attention group
    max_step_tokens: int = 1 << 62  # the most tokens one step computes for a request (the token budget)

    def __post_init__(self) -> None:
        if self.kinds.state and self.kinds.full + self.kinds.sliding:
            need = self.min_block_size(self.kinds)
            if self.block_size < need:
                raise ValueError(
                    f"block_size {self.block_size} is too small for the model's state layers: one page must "
                    f"hold a layer's state ({self.kinds.state_bytes:,} bytes per sequence on a GPU), so vLLM "
                    f"raises the attention block size to {need} tokens; set block_size = {need} (--block-size {need})")

    @staticmethod
    def min_block_size(kinds: LayerKinds) -> int:
        """The attention block size vLLM picks for a model with state layers: the smallest multiple
        of 16 tokens whose attention page holds one state."""
        per_block = STATE_BLOCK_ALIGNMENT * kinds.token_bytes
        return STATE_BLOCK_ALIGNMENT * _cdiv(kinds.state_bytes, per_block)

    # -- the groups -------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return self.kinds.group_size()

    @property
    def groups(self) -> tuple[int, int, int]:
        """(full, sliding, state) groups."""
        k, size = self.kinds, self.group_size
        return _cdiv(k.full, size), _cdiv(k.sliding, size), _cdiv(k.state, size)

    @property
    def page_bytes(self) -> int:
        """One layer's page: ``block_size`` tokens of attention KV, or one state (padded to the
        attention page, as vLLM pads it); every group's pages have this size."""
        k = self.kinds
        if k.full + k.sliding:
            return self.block_size * k.token_bytes
        return k.state_bytes

    @property
    def block_bytes(self) -> int:
        """One pool block: a page in each of the group size's layer tensors."""
        return self.page_bytes * self.group_size

    def pool_blocks(self, available_bytes: float) -> int:
        """Blocks a GPU's KV memory holds (vLLM ``get_num_blocks``: bytes // page // group size)."""
        return int(available_bytes // self.page_bytes // self.group_size)

    # -- what a request holds -----------------------------------------------------------------------
    def held(self, computed: int, new: int) -> int:
        """Pool blocks a request holds while a step computes ``new`` tokens on top of ``computed``."""
        full, sliding, state = self.groups
        bs = self.block_size
        total = computed + new
        blocks = -(-total // bs)
        held = full * blocks
        if sliding:
            skipped = computed - self.kinds.window + 1
            held += sliding * (blocks - (skipped // bs if skipped > 0 else 0))
        if state and total > 0:
            held += state
        return held

    def between(self, computed: int) -> int:
        """Pool blocks a request holds between steps with ``computed`` tokens computed, once the
        sliding groups freed the blocks no later token attends to."""
        return self.held(computed, 0)

    def sliding_blocks(self, computed: int, new: int) -> int:
        """Blocks of ONE sliding-window group while computing ``new`` tokens on top of ``computed``."""
        bs = self.block_size
        skipped = computed - self.kinds.window + 1
        return -(-(computed + new) // bs) - (skipped // bs if skipped > 0 else 0)

    def peak(self, tokens: int) -> int:
        """The most pool blocks a request of ``tokens`` tokens (prompt + output) ever holds, its prompt
        computed in steps of at most ``max_step_tokens`` (vLLM's ``max_memory_usage_bytes``)."""
        full, sliding, state = self.groups
        blocks = _cdiv(tokens, self.block_size)
        peak = full * blocks + (state if tokens > 0 else 0)
        if sliding:
            chunk = min(tokens, self.max_step_tokens)
            peak += sliding * min(blocks, _cdiv(self.kinds.window - 1 + chunk, self.block_size) + 1)
        return peak

    def transfer_bytes(self, computed: int, layer_token_bytes: int, layer_state_bytes: int) -> int:
        """Bytes a context of ``computed`` tokens moves to another engine (disaggregated prefill/decode),
        given one layer's KV bytes per token and one state layer's state, whole model: every full layer's
        tokens, a sliding layer's tokens in the blocks it still holds (its window), a state layer's state."""
        k = self.kinds
        total = k.full * computed * layer_token_bytes
        if k.sliding:
            skipped = computed - k.window + 1
            first = (skipped // self.block_size) * self.block_size if skipped > 0 else 0
            total += k.sliding * (computed - first) * layer_token_bytes
        if k.state and computed > 0:
            total += k.state * layer_state_bytes
        return total

    def describe(self) -> dict:
        full, sliding, state = self.groups
        return {"full_layers": self.kinds.full, "sliding_layers": self.kinds.sliding, "state_layers": self.kinds.state,
                "window": self.kinds.window, "group_size": self.group_size, "full_groups": full,
                "sliding_groups": sliding, "state_groups": state, "page_bytes": self.page_bytes,
                "block_size": self.block_size}


__all__ = ["KVLayout", "LayerKinds"]
