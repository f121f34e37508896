"""The global rows of a context-parallel call: rows that read keys on every rank, merged
across ranks by all-reduces (step 3 of :mod:`.attention`'s docstring). Each rank scores the
global queries against its own keys; the row max is all-reduced, then for softmax
Σ e^(z−m)·v and Σ e^(z−m) (log-sum-exp), for sparsemax, 1.5-entmax and α-entmax the threshold
τ is found by the algorithms of :mod:`sparseattn.fastmaps` (Michelot; Newton with the exact
closed-form finish; safeguarded Newton) with the row sums all-reduced at every step, so every
rank holds the same τ and the support is the one of the whole row. The backward is the closed
forms (softmax: dS = P ⊙ (dP − dO·O); the sparse maps: dS = s⊙dP − s·Σ(s⊙dP)/Σs with
s = p^(2−α), Σ all-reduced).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from . import comm

__all__ = ["MAX_STEPS", "GlobalRows"]

#: Most threshold steps of the global rows (each all-reduces a few values per row).
MAX_STEPS = 100


class GlobalRows:
    """The global rows, merged across ranks (module docstring, step 3). Products run in the
    inputs' dtype (float32 for half precision), the merge — maxima, sums, thresholds,
    weights — and its all-reduces in float64. Query heads that share a key/value head are
    stacked along the rows (no copy of k and v, as ``attention.group_queries``)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, call):
        self.call = call
        s = call.setup
        bsz, heads, _, d = q.shape
        g = s.global_mask.shape[-2]
        self.shape = (bsz, heads, g)
        self.ct = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
        qg = torch.zeros(bsz, heads, g, d, dtype=torch.float64, device=q.device)
        qg[:, :, s.global_slots] = q[:, :, s.global_local].detach().double()
        self.qg = comm.all_reduce(qg, call.group, "global_forward").to(self.ct)
        self.kl = k.detach().to(self.ct)
        self.vl = v.detach().to(self.ct)
        valid = s.global_mask.to(q.device)
        if call.valid is not None:
            valid = valid & call.valid[:, None, None, :]
        self.valid = valid.expand(bsz, heads, g, s.n_local)

    def _grouped(self, t: Tensor) -> Tensor:
        """(B, H, g, x) → (B, kv_heads, H/kv_heads·g, x) in the product dtype."""
        kv_heads = self.kl.shape[1]
        rows = t.shape[1] // kv_heads * t.shape[2]
        return t.to(self.ct).reshape(t.shape[0], kv_heads, rows, t.shape[-1])

    def _rows(self, t: Tensor) -> Tensor:
        """(B, kv_heads, H/kv_heads·g, x) → (B, H, g, x) in float64."""
        return t.double().reshape(*self.shape, t.shape[-1])

    def _sum(self, t: Tensor, kind: str = "global_forward") -> Tensor:
        return comm.all_reduce(t, self.call.group, kind)

    def forward(self) -> Tensor:
        call = self.call
        z = self._rows(self._grouped(self.qg) @ self.kl.transpose(-1, -2)) * call.scale
        zm = z.masked_fill(~self.valid, -math.inf)
        m = zm.amax(-1) if zm.shape[-1] else zm.new_full(zm.shape[:-1], -math.inf)
        m = comm.all_reduce(m, call.group, "global_forward", dist.ReduceOp.MAX)
        m = torch.where(torch.isfinite(m), m, 0.0)[..., None]
        kind = call.kind
        rho = call.rho.rho if call.support else call.rho  # the map whose support is asked
        self.factor = 1.0
        if kind == "softmax":  # log-sum-exp: e^(z − m) with m the max over every rank
            e = torch.where(self.valid, (z - m).exp(), 0.0)
            den = self._sum(e.sum(-1, keepdim=True))
            p = e / torch.where(den > 0, den, 1.0)
        elif kind == "hardmax":
            top = (self.valid & (z == m)).double()
            p = top / self._sum(top.sum(-1, keepdim=True)).clamp_min(1.0)
        else:
            alpha = 2.0 if kind == "sparsemax" else rho.params["alpha"]
            if rho.name == "sparselin_gen":  # sparsemax(z / (1 − λ)), Yun B.2
                self.factor = 1.0 / (1.0 - rho.params["lam"])
            self.alpha = alpha
            scale = self.factor if kind == "sparsemax" else alpha - 1.0
            x = torch.where(self.valid, (z - m) * scale, -math.inf)
            rows = x.shape[0] * x.shape[1] * x.shape[2]
            p = self._threshold(x.reshape(rows, x.shape[-1]), kind, alpha).view(x.shape)
        if call.support:  # the support indicator of the map (forward only)
            p = (p > 0).double()
        self.p = p
        self.o = self._sum(self._rows(self._grouped(p) @ self.vl))
        return self.o[:, :, call.setup.global_slots].to(call.q.dtype)

    def _threshold(self, x: Tensor, kind: str, alpha: float) -> Tensor:
        """p (R, K) of rows x (R, K) whose max over all ranks is 0 (−inf: not a key)."""
        rows = x.shape[0]
        t = x.new_full((rows, 1), -1.0)
        tau = t.clone()
        active = torch.ones(rows, dtype=torch.bool, device=x.device)
        group = self.call.group

        def step_sum(parts: list[Tensor]) -> Tensor:
            comm._add("steps", 1)
            return comm.all_reduce(torch.cat(parts, 1), group, "global_step")

        if kind == "sparsemax":  # Michelot: τ ← (Σ_S x − 1)/|S|, S = {x > τ}, until S is stable
            k_old = None
            for _ in range(MAX_STEPS):
                dd = (x - t).clamp_min(0.0)
                stats = step_sum(
                    [dd.sum(-1, keepdim=True), (dd > 0).double().sum(-1, keepdim=True)]
                )
                k = stats[:, 1:]
                if k_old is not None:
                    done = active & (k == k_old).squeeze(1)
                    tau[done] = t[done]
                    active &= ~done
                if not comm.any_left(active, group):
                    break
                t = torch.where(
                    active[:, None] & (k > 0), t + (stats[:, :1] - 1) / k.clamp_min(1), t
                )
                k_old = k
            tau[active] = t[active]
            return (x - tau).clamp_min(0.0)
        if kind == "entmax15":  # Newton on ‖[x − τ]₊‖₂ − 1, finished by the closed form on S
            for _ in range(MAX_STEPS):
                dd = (x - t).clamp_min(0.0)
                sums = [dd.sum(-1, keepdim=True), dd.square().sum(-1, keepdim=True)]
                stats = step_sum([*sums, (dd > 0).double().sum(-1, keepdim=True)])
                total, sq, k = stats[:, :1], stats[:, 1:2], stats[:, 2:]
                kc = k.clamp_min(1.0)
                mean = total / kc
                var = sq / kc - mean.square()
                exact = t + mean - ((1 - kc * var) / kc).clamp_min(0.0).sqrt()
                check = self._sum((x > exact).double().sum(-1, keepdim=True), "global_step")
                done = active & (check == k).squeeze(1)
                tau[done] = exact[done]
                active &= ~done
                if not comm.any_left(active, group):
                    break
                norm = sq.sqrt()
                newton = t + norm * (norm - 1) / total.clamp_min(torch.finfo(x.dtype).tiny)
                t = torch.where(active[:, None], newton, t)
            tau[active] = t[active]
            return (x - tau).clamp_min(0.0).square()
        # any other α: safeguarded Newton to float precision, then Σp = 1 (as one process)
        r = 1.0 / (alpha - 1.0)
        eps, tiny = torch.finfo(x.dtype).eps, torch.finfo(x.dtype).tiny
        count = self._sum(torch.isfinite(x).double().sum(-1, keepdim=True)).clamp_min(1.0)
        lo, hi = t.clone(), -count.pow(1.0 - alpha)
        for _ in range(MAX_STEPS):
            dd = (x - t).clamp_min(0.0)
            below = torch.where(dd > 0, dd.pow(r - 1.0), 0.0)  # d^(r−1) on the support
            stats = step_sum([dd.pow(r).sum(-1, keepdim=True), below.sum(-1, keepdim=True)])
            total, slope = stats[:, :1], stats[:, 1:] * r
            f = total - 1
            lo = torch.where(f >= 0, t, lo)
            hi = torch.where(f <= 0, t, hi)
            move = r * (total - total.pow(1.0 - 1.0 / r)) if r > 1 else f
            newton = t + move / slope.clamp_min(tiny)
            new = torch.where((newton >= lo) & (newton <= hi), newton, (lo + hi) / 2)
            done = active & (((new - t).abs() <= 4 * eps) | (hi - lo <= 4 * eps)).squeeze(1)
            tau[done] = new[done]
            active &= ~done
            t = torch.where(active[:, None], new, t)
            if not comm.any_left(active, group):
                break
        tau[active] = t[active]
        p = (x - tau).clamp_min(0.0).pow(r)
        total = self._sum(p.sum(-1, keepdim=True))
        return p / torch.where(total > 0, total, 1.0)

    def backward(self, grad: Tensor, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None):
        call, s = self.call, self.call.setup
        do = torch.zeros(*self.shape, self.o.shape[-1], dtype=torch.float64, device=grad.device)
        do[:, :, s.global_slots] = grad[:, :, s.global_local].double()
        do = self._sum(do, "global_backward")
        dp = self._rows(self._grouped(do) @ self.vl.transpose(-1, -2))
        p = self.p
        if call.kind == "softmax" and not call.support:
            ds = p * (dp - (do * self.o).sum(-1, keepdim=True))
        elif call.kind == "hardmax" or call.support:
            ds = torch.zeros_like(p)
        else:
            if self.alpha == 2.0:
                sp = (p > 0).double()
            else:
                sp = torch.where(p > 0, p.pow(2.0 - self.alpha), 0.0)
            stats = self._sum(
                torch.cat([(sp * dp).sum(-1, keepdim=True), sp.sum(-1, keepdim=True)], -1),
                "global_backward",
            )
            ratio = stats[..., :1] / torch.where(stats[..., 1:] > 0, stats[..., 1:], 1.0)
            ds = (sp * dp - sp * ratio) * self.factor
        ds = self._grouped(ds * call.scale)
        dqg = self._sum(self._rows(ds @ self.kl), "global_backward")
        if dq is not None:
            dq[:, :, s.global_local] += dqg[:, :, s.global_slots].to(dq.dtype)
        if dk is not None:  # the stacked rows sum over the query heads of a key/value head
            dk += (ds.transpose(-1, -2) @ self._grouped(self.qg)).to(dk.dtype)
        if dv is not None:
            dv += (self._grouped(p).transpose(-1, -2) @ self._grouped(do)).to(dv.dtype)
