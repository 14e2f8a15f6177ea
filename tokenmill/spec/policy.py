"""The scheduler's side of speculative decoding: when to speculate and how far. No tensors.

Speculation pays when the target's forward pass is bound by reading its weights, as in a small
batch: verifying K drafts then costs about what one token costs. In a large batch the pass is
bound by arithmetic, every rejected draft is paid for in full, and speculation loses; so it
switches itself off above `disable_batch_size` running requests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationPolicy:
    num_speculative_tokens: int  # K: the most drafts one step verifies for a request
    disable_batch_size: int | None  # no speculation while more requests than this run
    adaptive: bool  # each request's K follows its own acceptance
    drafter_writes_kv: bool  # a draft model or head fills KV slots ahead of the verified tokens

    def enabled_for(self, num_running: int) -> bool:
        return self.disable_batch_size is None or num_running <= self.disable_batch_size

    def lookahead_slots(self, num_to_draft: int) -> int:
        """KV slots a request needs beyond this step's tokens so its drafter can run ahead."""
        return num_to_draft if self.drafter_writes_kv else 0

    def next_num_to_draft(self, current: int, num_drafted: int, num_accepted: int) -> int:
        """After a verification: one more when every draft was accepted (up to K), else just
        one past the accepted run, so a request whose drafts miss stops paying for long ones."""
        if not self.adaptive or num_drafted == 0:
            return current
        if num_accepted == num_drafted:
            return min(current + 1, self.num_speculative_tokens)
        return num_accepted + 1
