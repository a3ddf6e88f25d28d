"""Multimodal requests' encoder stage and encoder cache (vLLM's ``EncoderCacheManager``).

A request with images, video or audio (trace columns ``images``, ``image_tokens``, ``image_hashes``,
``video_tokens``, ``audio_tokens``; the tokens are part of ``prompt_tokens``) has them encoded when
it is admitted: the encoder runs in the admitting iteration, before the language model's forward,
so its time is part of that iteration and of the request's TTFT. An image with a hash (its content:
``image_hashes``) that is in the replica's encoder cache is not encoded again; the cache holds
``capacity`` tokens of embeddings, least recently used first out. Video and audio are encoded every
time (no hashes). ``price(kind, tokens)``, given by the assembly, is the encoder's seconds for one
item on the replica's GPU (runners/encoders.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from servelab.replay.core.request import Request


class MultiModal(NamedTuple):
    """A request's multimodal inputs (``Request.mm``; None for a text-only request)."""

    images: int  # images in the prompt
    image_tokens: int  # prompt tokens they become, all images together (split evenly among them)
    image_hashes: list[int] | None  # one content hash per image (None: every image is new)
    video_tokens: int
    audio_tokens: int

    def image_sizes(self) -> list[int]:
        """Each image's tokens: ``image_tokens`` split evenly, the first images taking the remainder."""
        n = self.images or (1 if self.image_tokens else 0)
        if not n:
            return []
        q, r = divmod(self.image_tokens, n)
        return [q + (i < r) for i in range(n)]


class EncoderStage:
    """One replica's encoder: prices items and keeps the encoder cache. Counts what it did."""

    __slots__ = ("price", "capacity", "cache", "used", "encoded", "hits", "encode_s")

    def __init__(self, price: Callable[[str, int], float], capacity: int):
        self.price = price
        self.capacity = capacity  # tokens of embeddings the cache holds
        self.cache: OrderedDict[int, int] = OrderedDict()  # image hash -> its tokens
        self.used = 0
        self.encoded = 0  # items encoded
        self.hits = 0  # images served from the cache
        self.encode_s = 0.0

    def admit(self, req: "Request") -> float:
        """Encode what ``req`` needs that the cache lacks; returns the encoder's seconds."""
        return self.encode(req.mm)

    def encode(self, mm: MultiModal) -> float:
        """Encode the items of ``mm`` that the cache lacks; returns the encoder's seconds."""
        seconds = 0.0
        hashes = mm.image_hashes
        for i, tokens in enumerate(mm.image_sizes()):
            key = hashes[i] if hashes is not None and i < len(hashes) else None
            if key is not None and key in self.cache:
                self.cache.move_to_end(key)
                self.hits += 1
                continue
            seconds += self.price("image", tokens)
            self.encoded += 1
            if key is not None:
                self._insert(key, tokens)
        for kind, tokens in (("video", mm.video_tokens), ("audio", mm.audio_tokens)):
            if tokens:
                seconds += self.price(kind, tokens)
                self.encoded += 1
        self.encode_s += seconds
        return seconds

    def state(self) -> tuple:
        """What the encodings so far left (the cache, its LRU order, the counters), for ``restore``: an
        encode pool prices a request when it queues it, and one taken off the queue before its encoding
        started must leave no trace (replay/cluster/encode_pool.py)."""
        return OrderedDict(self.cache), self.used, self.encoded, self.hits, self.encode_s

    def restore(self, state: tuple) -> None:
        """Back to ``state`` (from ``state()``), as if nothing was encoded since."""
        cache, self.used, self.encoded, self.hits, self.encode_s = state
        self.cache = OrderedDict(cache)

    def _insert(self, key: int, tokens: int) -> None:
        if tokens > self.capacity:
            return  # larger than the whole cache: used once, not kept
        while self.used + tokens > self.capacity:
            _, freed = self.cache.popitem(last=False)
            self.used -= freed
        self.cache[key] = tokens
        self.used += tokens


def encoder_meta(replicas) -> dict:
    """run.json's ``encoder`` section, summed over the replicas."""
    stages = [r.encoder for r in replicas if r.encoder is not None]
    return {"items_encoded": sum(s.encoded for s in stages), "cache_hits": sum(s.hits for s in stages),
            "encode_s": sum(s.encode_s for s in stages)}


MM_COLUMNS = ("images", "image_tokens", "image_hashes", "audio_tokens", "video_tokens")


def attach(requests: list["Request"], columns: dict[str, list]) -> int:
    """Give each request with multimodal inputs its ``mm`` (``columns``: the trace's MM_COLUMNS present,
    one list per column in request order); returns how many have some."""
    n = len(requests)
    get = {name: columns.get(name) or [None] * n for name in MM_COLUMNS}
    count = 0
    for i, req in enumerate(requests):
        images, image_tokens = get["images"][i] or 0, get["image_tokens"][i] or 0
        video, audio = get["video_tokens"][i] or 0, get["audio_tokens"][i] or 0
        hashes = get["image_hashes"][i] or None
        if images or image_tokens or video or audio:
            req.mm = MultiModal(images, image_tokens, hashes, video, audio)
            count += 1
    return count


__all__ = ["MM_COLUMNS", "EncoderStage", "MultiModal", "attach", "encoder_meta"]
