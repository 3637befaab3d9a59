"""`pdserve soak` parts: the fault schedule (time or progress triggers), the load faults (cancels
during prefill, forged KV blocks), the client workload with its ledger of outcomes, and
the end-of-run invariants (also used by the fuzz tests to check a stack after fuzzing)."""
