"""One engine replica: its queues, its KV cache and its policy instance (the state a policy sees)."""

from __future__ import annotations

import math

from servelab.replay.core.engine_config import EngineConfig
from servelab.replay.core.kv.manager import KVManager
from servelab.replay.core.queue import RequestQueue
from servelab.replay.core.request import Request


class Replica:
    """Policies read ``now_s``, ``waiting``, ``running``, ``kv`` and ``config``; only the engine writes.

    ``waiting`` is in queue order: arrivals at the back, preempted requests at the front (vLLM).
    ``running`` is in admission order: the default preemption victim is its last element.
    ``aggregate``: what the batch builder keeps across decisions, for a policy that reads running
    requests only through it (``batch.ReadsRunning``), or None; then running requests' counters are
    current only through ``BatchBuilder``.
    """

    __slots__ = ("id", "config", "kv", "policy", "waiting", "running", "now_s", "busy", "step_token",
                 "inflight", "schedule_pending", "outstanding_tokens", "wake_s", "aggregate",
                 "runner", "decode_affine", "pool", "lora", "encoder", "group", "visible_s", "iter_start_s",
                 "step_end_s", "last_arrival_s", "holding", "landed_s")

    def __init__(self, replica_id: int, config: EngineConfig, kv: KVManager, policy):
        # ``policy`` is a `Policy` (replay/core/protocols.py); not imported here: the protocol is written in
        # terms of the replica it schedules, so the replica sits below it
        self.id = replica_id
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.now_s = 0.0
        self.busy = False
        self.step_token = 0  # identifies the in-flight step; stale completion events are ignored
        self.inflight = None  # the Step being executed
        self.schedule_pending = False
        # Prompt + output tokens routed here and not yet produced (the least-outstanding router's
        # load): ``owe`` on routing, ``forgive`` when a request leaves unserved, and the engine
        # subtracts what each applied step produced. The tests check it against ``owed`` of every
        # request here after every event, and that it drains to 0.
        self.outstanding_tokens = 0
        self.wake_s: float | None = None
        self.aggregate = None  # set by ``batch.aggregate_decodes`` when the engine allows it
        self.runner = None  # its pool's runner when it differs from the engine's (set by the engine)
        self.decode_affine = None  # its runner's cached pure-decode cost line (set by the engine)
        self.pool = None  # the name of its cluster pool (replay/cluster/config.py), None outside a cluster
        self.lora = None  # its AdapterSlots (replay/core/lora.py) when LoRA serving is on (max_loras > 0)
        self.encoder = None  # its EncoderStage (replay/core/encoder.py) when a multimodal encoder is configured
        self.group = None  # its DpGroup (replay/core/lockstep.py) when its DP ranks step together
        # async scheduling (EngineConfig.async_scheduling): a decision admits only waiting requests that
        # arrived by ``visible_s``, the start of the iteration that just ended (the scheduler had picked
        # the step now starting while that one ran); inf when every waiting request may go in
        self.visible_s = math.inf
        self.iter_start_s = 0.0  # the start of the last iteration of the step that ended last
        self.step_end_s = -1.0  # when that step ended
        self.last_arrival_s = -math.inf  # when a request last joined the waiting queue (its queued_s)
        self.holding = False  # a waiting request arrived after ``visible_s``
        self.landed_s = -math.inf  # when a request's KV last landed here (a decode pool's replica)

    def owe(self, req: Request) -> None:
        self.outstanding_tokens += (req.prompt_tokens if req.first_token_s is None else 0) + \
            req.output_tokens - req.num_generated_tokens  # owed(req), inline: once per arrival

    def forgive(self, req: Request) -> None:
        self.outstanding_tokens -= owed(req)


def owed(req: Request) -> int:
    """Tokens ``req`` has still to produce: its prompt until its first token, then its outputs."""
    return (req.prompt_tokens if req.first_token_s is None else 0) + req.output_tokens - req.num_generated_tokens
