"""ResourceManager: what happens to a sequence's Program resources when a request settles.

The seed gives it continuation owners, restore points, a shared prefix index and session hints,
adopting what the Program returns; it never keeps a second physical ledger. Prefix reuse is not
built yet, so today every finished sequence is released and every dropped ResumeState discarded;
this is the one place that policy will grow.
"""
from __future__ import annotations


class ResourceManager:
    def __init__(self, program):
        self.program = program

    def settle_finished(self, seq_id: int) -> None:
        """A resident request reached its terminal state: nothing is retained (no prefix cache)."""
        self.program.release(seq_id)

    def settle_paused(self, resume_state) -> None:
        """A paused request ended: its Snapshot host memory (if any) goes back."""
        self.program.discard(resume_state)
