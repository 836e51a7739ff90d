"""The two communication patterns of sequence parallelism: the Ulysses all-to-all (differentiable: its
backward is the inverse all-to-all) and the ring shift of K/V blocks (asynchronous point-to-point)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single over dim 0 of x ([n, ...], n = group size): part i goes to rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after .contiguous(): empty_like keeps a view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return _seq_to_heads(x, group, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad, ctx.group, ctx.n), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return _heads_to_seq(x, group, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.group, ctx.n), None, None


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    parts = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # [n, B, H/n, S, D]: head group i → rank i
    got = _all_to_all(parts, group)  # [n, B, H/n, S, D]: sequence slice i ← rank i
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    parts = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4)  # [n, B, H, S/n, D]: slice i → rank i
    got = _all_to_all(parts, group)  # [n, B, H, S/n, D]: head group i ← rank i
    return got.transpose(0, 1).reshape(b, n * h, s // n, d)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> torch.Tensor:
    """Ulysses all-to-all: [B, H, S/n, D] sharded by sequence → [B, H/n, S, D] sharded by heads (rank i
    gets heads i·H/n … (i+1)·H/n − 1, sequence slices concatenated in rank order). Differentiable."""
    if n == 1:
        return x
    return _SeqToHeads.apply(x, group, n)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> torch.Tensor:
    """Inverse of `seq_to_heads`: [B, H/n, S, D] → [B, H, S/n, D]. Differentiable."""
    if n == 1:
        return x
    return _HeadsToSeq.apply(x, group, n)


class PendingShift:
    """Point-to-point transfers in flight; `wait()` returns the received tensors."""

    def __init__(self, sent: list[torch.Tensor], bufs: list[torch.Tensor], reqs: list) -> None:
        self._sent, self._bufs, self._reqs = sent, bufs, reqs  # sent tensors live until the sends finish

    def wait(self) -> list[torch.Tensor]:
        for r in self._reqs:
            r.wait()
        self._sent = []
        return self._bufs


def ring_shift(tensors: list[torch.Tensor], group: dist.ProcessGroup, tag: int = 0) -> PendingShift:
    """Start sending `tensors` to the next ring rank and receiving the previous rank's (same shapes).
    Transfers that may be in flight together must use different `tag`s."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
    sent = [t.contiguous() for t in tensors]
    bufs = [torch.empty_like(t) for t in sent]
    reqs = []
    for t, buf in zip(sent, bufs, strict=True):
        reqs.append(dist.isend(t, dst=nxt, group=group, tag=tag))
        reqs.append(dist.irecv(buf, src=prv, group=group, tag=tag))
    return PendingShift(sent, bufs, reqs)
