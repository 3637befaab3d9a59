"""Sticky assignment: a session (or user) keeps the arm it was first given.

A new session id asks the policy (`Policy.choose`); a known one gets its recorded arm back without
a new pull. When an arm goes down (`mark_down`) the policy stops choosing it and every session on
it is reassigned at once through the policy to the arms still up; when it comes back (`mark_up`)
the policy may choose it for new sessions, and the moved sessions stay where they now are.
Requests without a session id get a fresh choice each time and are not remembered. The table is
bounded: beyond `max_sessions` the least recently used session is forgotten.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from gateway.experiments.policies import Policy


class StickyAssigner:
    """Session id -> arm, over one experiment's policy."""

    def __init__(self, policy: Policy, rng: random.Random, *, max_sessions: int = 100_000) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.policy = policy
        self.rng = rng
        self.max_sessions = max_sessions
        self._arm_of: OrderedDict[str, str] = OrderedDict()

    def assign(self, session_id: str | None) -> str:
        """The arm for a request of `session_id` (sticky), or a fresh choice when it is None."""
        if session_id is None:
            return self.policy.choose(self.rng)
        arm = self._arm_of.get(session_id)
        if arm is not None:
            self._arm_of.move_to_end(session_id)
            return arm
        arm = self.policy.choose(self.rng)
        self._arm_of[session_id] = arm
        while len(self._arm_of) > self.max_sessions:
            self._arm_of.popitem(last=False)
        return arm

    def arm_of(self, session_id: str) -> str | None:
        """The arm `session_id` is on, or None when it is not known."""
        return self._arm_of.get(session_id)

    def sessions_on(self, arm: str) -> list[str]:
        """The session ids currently assigned to `arm`."""
        return [sid for sid, a in self._arm_of.items() if a == arm]

    def forget(self, session_id: str) -> None:
        """Drop `session_id` (its next request asks the policy again)."""
        self._arm_of.pop(session_id, None)

    def mark_down(self, arm: str) -> dict[str, str]:
        """Take `arm` out; its sessions move to arms still up. Returns {session id: new arm}.

        When no arm is left up its sessions are forgotten instead (their next request raises
        `NoArmAvailable` until an arm comes back) and the result is empty.
        """
        self.policy.mark_down(arm)
        moved: dict[str, str] = {}
        for sid in self.sessions_on(arm):
            if not self.policy.active_arms():
                self.forget(sid)
                continue
            moved[sid] = self._arm_of[sid] = self.policy.choose(self.rng)
        return moved

    def mark_up(self, arm: str) -> None:
        """Bring `arm` back for new sessions (moved sessions stay on their new arm)."""
        self.policy.mark_up(arm)

    def __len__(self) -> int:
        return len(self._arm_of)
