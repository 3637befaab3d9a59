"""The command channel from rank 0 to the other ranks of its group, over the group's broadcasts.

Rank 0 drives: every command is a 4-int header broadcast (op, three arguments), then its payload.
The other ranks wait for headers in a loop (`follower`). Commands that call collectives inside
(a step's forward: one all-reduce per row-parallel projection) are sent and run under
`Channel.lock` on rank 0, so that nothing else goes on the group in between; the heartbeat thread
takes the lock too. A follower waiting for the next header would time out while rank 0 idles, so
rank 0 sends a NOOP whenever the group has been quiet for a quarter of the collective timeout.

Step inputs travel as one int64 tensor (`pack_step`): the flat token ids, positions and slots,
the decode rows' block tables and context lengths, and each prefill chunk's span and block table.
"""

from __future__ import annotations

import enum
import logging
import threading
import time

import torch

from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
from pdserve.runtime.parallel.group import TPGroup

log = logging.getLogger(__name__)


class Op(enum.IntEnum):
    NOOP = 0  # heartbeat
    STEP = 1  # a: payload length, b: micro-batches (pipeline); then the packed step, then the forward
    LOGITS = 2  # a: rows; then hidden [rows, D] as bytes, then the logits gather
    PUT_BLOCK = 3  # a: block id, b: bytes; then the canonical block as bytes
    GET_BLOCK = 4  # a: block id; then each rank's shard of the block gathered to rank 0
    STOP = 5
    STATS = 6  # a: reset after; then every rank's stage stats gathered to rank 0 (pipeline)


class Channel:
    """Rank 0's end: sends headers and payloads; `lock` held across a command and its collectives."""

    def __init__(self, group: TPGroup, heartbeat_s: float) -> None:
        self.group = group
        self.lock = threading.Lock()
        self.last_sent = time.monotonic()
        self.closed = False
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True, name="tp-heartbeat")
        self._heartbeat.start()

    def send(self, op: Op, a: int = 0, b: int = 0, c: int = 0) -> None:
        """The header; the caller holds `lock` and sends the payload next."""
        header = torch.tensor([int(op), a, b, c], dtype=torch.long, device=self.group.device)
        self.group.broadcast(header)
        self.last_sent = time.monotonic()

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s / 4):
            if time.monotonic() - self.last_sent < every_s or not self.lock.acquire(timeout=every_s):
                continue
            try:
                if not self.closed:
                    self.send(Op.NOOP)
            except Exception as exc:  # noqa: BLE001 - a dead rank; the next step reports it
                log.warning("tensor-parallel heartbeat failed: %s", exc)
                self._stop.set()
            finally:
                self.lock.release()

    def close(self, send_stop: bool = True) -> None:
        """Stops the heartbeat and tells the other ranks to exit (best effort: they also exit when
        rank 0's sockets close)."""
        self._stop.set()
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if not send_stop:
                return
            try:
                self.send(Op.STOP)
            except Exception as exc:  # noqa: BLE001
                log.debug("STOP not delivered: %s", exc)


def recv_header(group: TPGroup) -> tuple[Op, int, int, int]:
    header = group.broadcast(torch.empty(4, dtype=torch.long, device=group.device))
    op, a, b, c = header.tolist()
    return Op(op), a, b, c


def send_bytes(group: TPGroup, t: torch.Tensor) -> None:
    """Broadcasts t (any dtype: sent as bytes, which every backend carries) from rank 0."""
    group.broadcast(t.contiguous().view(torch.uint8).view(-1))


def recv_bytes(group: TPGroup, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    buf = group.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=group.device))
    return buf.view(dtype).view(shape)


# ---- step inputs --------------------------------------------------------------------------
def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One int64 tensor: [N, B, W, P, G, ids N, positions N, slots N, block tables B*W, context lens B,
    generated rows N (0/1) where G is 1, then per prefill chunk: query_start, query_len, context_len,
    blocks, its block table]. The generated rows travel so that every rank's int4 projections split a
    step's rows by token kind as rank 0's do (quant.int4_cpu.token_kinds), not by their count."""
    dev = input_ids.device
    bt = meta.decode_block_tables
    b, w = (bt.shape[0], bt.shape[1]) if bt.dim() == 2 else (0, 0)
    generated = meta.generated_rows

    def ints(*v: int) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.long, device=dev)

    parts = [ints(input_ids.numel(), b, w, len(meta.prefills), int(generated is not None)), input_ids.long(),
             positions.long(), meta.slot_mapping.long(), bt.reshape(-1).long(),
             meta.decode_context_lens.reshape(-1).long()]
    if generated is not None:
        parts.append(generated.to(device=dev, dtype=torch.long))
    for p in meta.prefills:
        parts += [ints(p.query_start, p.query_len, p.context_len, p.block_table.numel()), p.block_table.long()]
    return torch.cat(parts)


def unpack_step(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    n, b, w, p, g = flat[:5].tolist()
    at = 5
    ids, pos, slots = flat[at:at + n], flat[at + n:at + 2 * n], flat[at + 2 * n:at + 3 * n]
    at += 3 * n
    tables = flat[at:at + b * w].view(b, w)
    at += b * w
    lens = flat[at:at + b]
    at += b
    generated = None
    if g:
        generated = flat[at:at + n].bool().cpu()  # [N]: read on the host, as rank 0's
        at += n
    spans = []
    for _ in range(p):
        qs, ql, cl, nb = flat[at:at + 4].tolist()
        spans.append(PrefillSpan(qs, ql, cl, flat[at + 4:at + 4 + nb]))
        at += 4 + nb
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=b, decode_block_tables=tables,
                             decode_context_lens=lens, prefills=tuple(spans), generated_rows=generated)
    return ids, pos, meta
