"""Data-parallel ranks that step together: vLLM's DP with a mixture-of-experts model.

With ``--data-parallel-size`` > 1 and an MoE model, vLLM's DP ranks (one engine core each, with its
own scheduler and KV cache) meet in every forward pass: each MoE layer gathers every rank's tokens
for the experts. So they step in lockstep: a rank with nothing to do runs a dummy batch while another
works, every rank pads its batch to the most tokens any rank has this step (its linear layers,
experts and collectives run that many), and no rank starts its next step before the slowest has
finished this one. A request that reaches an idle rank while the others are mid-step waits for
their step to end.

`DpGroup` holds one replica's ranks (engines, `replay.core.replica.Replica`) and makes their steps
one round: the first rank to start a step at an instant opens a round; every rank that starts a step
at that instant joins it; after the instant's decisions (the engine's ``AFTER_DECISIONS`` event) the
round closes: each rank's step is repriced for what the other ranks carry (the runner's
``dp_lockstep_s``: padding, or the experts seeing every rank's tokens) and every step ends with the
slowest. A rank whose ``_start`` comes while a round is in flight is held: it decides at the round's
end. Ranks in a group run one iteration per step (no decode stretches: their iterations must line up).
"""

from __future__ import annotations


class DpGroup:
    """The DP ranks of one replica, stepping together. Built by the assembly when the runner says its
    ranks step in lockstep (``runner.dp_lockstep``); the engine calls ``holds`` and ``joined``."""

    __slots__ = ("members", "runner", "engine", "end_s", "round")

    def __init__(self, members: list, runner):
        self.members = members
        self.runner = runner
        self.engine = None  # set by the engine that runs the members
        self.end_s = -1.0  # when the round in flight ends (at or before now: none in flight)
        self.round: list = []  # (replica, step) of the round being formed at this instant
        for replica in members:
            replica.group = self

    def holds(self, replica, now: float) -> bool:
        """Whether ``replica`` must wait for the round in flight: then it decides at the round's end. (A
        round being formed at ``now`` is not in flight yet: its end is set when it closes.)"""
        if self.end_s <= now:
            return False
        self.engine.schedule_at(replica, self.end_s)
        return True

    def joined(self, replica, step, now: float) -> None:
        """``replica`` started ``step`` at ``now``: it joins the round forming at this instant (the first
        to join opens it and asks to close it after the instant's decisions)."""
        if not self.round:
            self.engine.after_decisions(now, self.close)
        self.round.append((replica, step))

    def close(self, now: float) -> None:
        """Every rank that decided at ``now`` has joined: pad, and end every step with the slowest."""
        steps = self.round
        self.round = []
        tokens = [step.prefill_tokens + step.decode_requests for _, step in steps]
        group = (*tokens, *[0] * (len(self.members) - len(tokens)))  # an idle rank runs an empty dummy batch
        extra = self.runner.dp_lockstep_s
        end_s = max(step.end_s + extra(n, group) for (_, step), n in zip(steps, tokens))
        self.end_s = end_s
        engine = self.engine
        for replica, step in steps:
            if step.end_s != end_s:
                step.end_s = end_s
                engine.retime(replica, end_s)
