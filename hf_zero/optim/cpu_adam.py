"""A fast Adam/AdamW step for fp32 shards held in CPU memory (ZeRO-Offload).

The arithmetic is torch's own fused CPU Adam kernel (``torch._fused_adamw_`` /
``torch._fused_adam_``, vectorised and parallelised over the intra-op threads), run over the flat
shard in cache-sized tiles. Tiling buys two things: an ``on_tile`` callback can start copying an
updated tile back to the accelerator while the next tile is being updated, and optional bf16
optimizer state is widened to fp32 one tile at a time, so it costs no full-size temporary.

`adam_step` serves any torch ``Adam``/``AdamW`` the user built (its hyperparameters, param groups
and state layout are used as they are, so schedulers and ``state_dict()`` keep working); `CPUAdam`
is an ``AdamW`` whose ``step()`` always takes this path and which can keep its state in bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TileHook = Callable[[torch.Tensor, int, int], None]

DEFAULT_TILE = 1 << 20  # elements: 4 MiB per fp32 tensor, a few tensors fit in a large L2/L3


def supports_fast_step(optimizer: torch.optim.Optimizer) -> bool:
    """True for a torch Adam/AdamW whose options the fused CPU kernel implements."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    return all(
        not g.get("amsgrad", False) and not g.get("maximize", False) for g in optimizer.param_groups
    )


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        group.get("decoupled_weight_decay", False)
    )


@torch.no_grad()
def adam_step(
    optimizer: torch.optim.Optimizer,
    tile_numel: int = DEFAULT_TILE,
    state_dtype: torch.dtype = torch.float32,
    on_tile: TileHook | None = None,
) -> None:
    """One Adam/AdamW step of ``optimizer`` over its (flat, CPU) parameters, tile by tile.

    State is stored under torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so the optimizer
    object stays a valid torch optimizer. ``on_tile(param, start, end)`` runs after each tile.
    """
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        lr = lr.item() if torch.is_tensor(lr) else lr
        kernel = torch._fused_adamw_ if _decoupled(optimizer, group) else torch._fused_adam_
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
            step = state["step"]
            step += 1
            m, v = state["exp_avg"], state["exp_avg_sq"]
            flat_p, flat_g = p.view(-1), p.grad.view(-1)
            flat_m, flat_v = m.view(-1), v.view(-1)
            widen = m.dtype != p.dtype
            # Tiles only where they buy something: a copy-back to overlap, or bf16 state to widen.
            tile = tile_numel if (on_tile is not None or widen) else flat_p.numel()
            if widen:
                wide_m = torch.empty(min(tile, flat_p.numel()), dtype=p.dtype)
                wide_v = torch.empty_like(wide_m)
            for start in range(0, flat_p.numel(), tile):
                end = min(start + tile, flat_p.numel())
                tm, tv = flat_m[start:end], flat_v[start:end]
                if widen:
                    tm = wide_m[: end - start].copy_(tm)
                    tv = wide_v[: end - start].copy_(tv)
                kernel(
                    [flat_p[start:end]],
                    [flat_g[start:end]],
                    [tm],
                    [tv],
                    [],
                    [step],
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                )
                if widen:
                    flat_m[start:end].copy_(tm)
                    flat_v[start:end].copy_(tv)
                if on_tile is not None:
                    on_tile(p, start, end)


class CPUAdam(torch.optim.AdamW):
    """AdamW for CPU-resident parameters: torch's fused kernel over tiles, optional bf16 state.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        tile_numel: elements updated per kernel call.
        state_dtype: ``torch.float32`` (default, exact AdamW) or ``torch.bfloat16``: halves the
            host memory of the two moments (8 -> 4 bytes per parameter) at the cost of rounding
            them to 8 significant bits after every step; updates then differ from fp32 AdamW
            by about 0.4% relative.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        tile_numel: int = DEFAULT_TILE,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"CPUAdam: 'state_dtype' = {state_dtype}; allowed: torch.float32, torch.bfloat16"
            )
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.tile_numel = tile_numel
        self.state_dtype = state_dtype
        self.on_tile: TileHook | None = None
        """Called after each tile by `step()` (the offloaded step passes its own to `adam_step`)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        adam_step(self, self.tile_numel, self.state_dtype, self.on_tile)
        return loss
