"""The soak's request ledger checked against the references: none lost, none duplicated, every
stream's tokens right, every ending a documented one.

`references[prompt]` is the in-process engine's greedy output for the longest length; a request
with max_tokens n expects its first n tokens (greedy is a prefix property; an EOS ends both).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.soak.workload import DOCUMENTED, Outcome, RequestSpec


@dataclass
class LedgerReport:
    sent: int
    by_status: dict[str, int]
    completed_exact: int  # OK streams equal to their reference
    lost: list[str] = field(default_factory=list)  # sent, no outcome
    duplicated: list[str] = field(default_factory=list)  # more than one outcome, foreign ids, chunks after the end
    wrong_tokens: list[str] = field(default_factory=list)  # not the reference (OK) or not a prefix of it
    undocumented: list[str] = field(default_factory=list)  # "id: STATUS details"
    by_kind: dict[str, int] = field(default_factory=dict)  # outcomes of each RequestSpec.kind
    wrong_by_kind: dict[str, int] = field(default_factory=dict)  # of them, tokens not the reference

    def problems(self) -> list[str]:
        out = []
        for name in ("lost", "duplicated", "wrong_tokens", "undocumented"):
            items = getattr(self, name)
            if items:
                out.append(f"{len(items)} {name.replace('_', ' ')}: {', '.join(items[:5])}")
        return out


def check_ledger(sent: Sequence[RequestSpec], outcomes: Sequence[Outcome],
                 references: Sequence[Sequence[int]]) -> LedgerReport:
    counts = Counter(o.spec.request_id for o in outcomes)
    report = LedgerReport(len(sent), dict(Counter(o.status for o in outcomes)), 0,
                          by_kind=dict(Counter(o.spec.kind for o in outcomes)))
    wrong_by_kind: Counter[str] = Counter()
    report.lost = [s.request_id for s in sent if counts[s.request_id] == 0]
    report.duplicated = [rid for rid, n in counts.items() if n > 1]
    for o in outcomes:
        rid = o.spec.request_id
        if o.foreign_ids or o.after_finish or len(o.finish_reasons) > 1:
            report.duplicated.append(f"{rid} ({o.foreign_ids} foreign-id chunks, {o.after_finish} after the end)")
        wrong = _wrong_tokens(o, list(references[o.spec.prompt][:o.spec.max_tokens]))
        if wrong:
            wrong_by_kind[o.spec.kind] += 1
            report.wrong_tokens.append(wrong)
        elif o.status == "OK":
            report.completed_exact += 1
        if o.status not in ("OK", "CANCELLED") and (o.status not in DOCUMENTED or not o.details.strip()):
            report.undocumented.append(f"{rid}: {o.status} {o.details[:120]}")
    report.wrong_by_kind = dict(wrong_by_kind)
    return report


def _wrong_tokens(o: Outcome, expected: list[int]) -> str:
    """What is wrong with `o`'s tokens ("" when right): a completed stream must equal `expected`,
    any other must be a prefix of it."""
    rid = o.spec.request_id
    if o.status == "OK":
        if o.tokens == expected and o.finish_reasons:
            return ""
        return f"{rid} got {len(o.tokens)} tokens, expected {len(expected)}" + (
            "" if o.finish_reasons else " (no finish reason)")
    if o.tokens != expected[:len(o.tokens)]:
        return f"{rid} ({o.status}) is not a prefix of the reference"
    return ""
