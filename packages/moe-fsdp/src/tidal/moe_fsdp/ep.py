"""Expert parallelism: the experts are split in equal contiguous blocks over an EP process group, and each
rank's expert-sorted tokens travel to the rank that holds their expert with one uneven all-to-all.

Per forward: (1) all-to-all of the per-expert counts [E] so every rank knows what it will receive,
(2) all-to-all of the token rows, (3) a local regroup by expert, (4) the experts, (5) the inverse of
(3) and (2). Backward is the same all-to-alls with the splits swapped. Works on any backend with
`all_to_all_single` (gloo on CPU, NCCL on GPU); the counts live on the tokens' device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """rows [sum(in_splits), ...] → [sum(out_splits), ...]; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all over the first dimension of x."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def run_experts_parallel(experts, x_sorted: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """Apply the group's experts to this rank's expert-sorted rows.

    experts: this rank's `GroupedExperts` (E_local = E / ep_size of them, global ids
    [rank·E_local, (rank+1)·E_local)); x_sorted [N, H] sorted by global expert id; counts [E] int64
    (`sort_by_expert`) → [N, H], row for row the expert outputs of x_sorted."""
    ep, local = dist.get_world_size(group), experts.num_experts
    if counts.numel() != ep * local:
        raise ValueError(f"{counts.numel()} experts cannot be split over an EP group of {ep} ranks holding "
                         f"{local} each; num_experts must equal ep_size × local experts")
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [ep·local]: from rank r for local expert j
    send = counts.view(ep, local).sum(1).tolist()
    recv_by_rank = recv_counts.view(ep, local)
    recv = recv_by_rank.sum(1).tolist()
    x_recv = all_to_all(x_sorted, recv, send, group)  # [M, H] grouped by (source rank, local expert)
    expert_of_row = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(recv_counts)
    regroup = torch.argsort(expert_of_row, stable=True)  # → grouped by local expert, then source rank
    y_local = experts(x_recv.index_select(0, regroup), recv_by_rank.sum(0).tolist())
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    return all_to_all(y_local.index_select(0, inverse), send, recv, group)
