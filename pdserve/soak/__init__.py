"""`pdserve soak` parts: the fault schedule, the client workload with its ledger of outcomes, and
the end-of-run invariants (also used by the fuzz tests to check a stack after fuzzing)."""
