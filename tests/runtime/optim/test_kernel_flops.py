"""The planner's FLOP and state-size formulas (canzona.planner.formulas) against the kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from canzona.planner import formulas
from canzona.runtime.optim import SOAP, AdamW, Muon, MuonConfig, Shampoo, ShampooConfig, SOAPConfig


def _counted(fn) -> int:
    """Matmul FLOPs (mm/addmm/bmm/baddbmm) ``fn`` performs; decompositions are not counted."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (40, 40)])
@pytest.mark.parametrize("ns_coefficients", ["default", "quintic"])
def test_muon_flops_equal_counted_matmuls(shape, ns_coefficients):
    cfg = (
        MuonConfig()
        if ns_coefficients == "default"
        else MuonConfig(ns_coefficients="quintic", ns_steps=10)
    )
    opt = Muon(cfg)
    grads = [torch.randn(shape) for _ in range(3)]
    states = [opt.init_state(shape) for _ in grads]
    formula = formulas.muon_flops(*shape, ns_steps=cfg.ns_steps)
    assert opt.flops(shape) == formula
    assert _counted(lambda: opt.direction(grads[:1], states[:1])) == formula
    # The batched path performs exactly the per-matrix work, once per matrix.
    assert _counted(lambda: opt.direction(grads, states)) == 3 * formula


def _shampoo_root_matmuls(opt: Shampoo, shape) -> int:
    """Q·diag·Qᵀ per side per block: the matmul part of an inverse-root recomputation."""
    total = 0
    for _, _, rows, cols in opt.blocks(shape):
        for k in (rows.stop - rows.start, cols.stop - cols.start):
            total += 2 * k**3
    return total


@pytest.mark.parametrize(("shape", "dim"), [((40, 24), 16), ((20, 20), 1024), ((16, 33), 16)])
def test_shampoo_flops_equal_counted_matmuls(shape, dim):
    cfg = ShampooConfig(max_preconditioner_dim=dim, precondition_frequency=10, momentum=0.9)
    opt = Shampoo(cfg)
    state = opt.init_state(shape)
    per_step = formulas.shampoo_flops(
        *shape, max_preconditioner_dim=dim, precondition_frequency=10, amortised=False
    )
    assert opt.flops(shape, amortised=False) == per_step
    # Step 1 recomputes the roots (eigh is not counted, its Q·diag·Qᵀ product is).
    step1 = _counted(lambda: opt.direction([torch.randn(shape)], [state]))
    assert step1 == per_step + _shampoo_root_matmuls(opt, shape)
    # Step 2 is an ordinary step.
    assert _counted(lambda: opt.direction([torch.randn(shape)], [state])) == per_step
    assert opt.flops(shape) > per_step  # amortised adds the root cost


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (30, 60), (60, 30)])
def test_soap_flops_equal_counted_matmuls(shape):
    dim, freq = 45, 3
    opt = SOAP(SOAPConfig(max_precond_dim=dim, precondition_frequency=freq))
    state = opt.init_state(shape)
    m, n = shape
    sides = [k for k in shape if k <= dim]
    per_step = formulas.soap_flops(
        m, n, max_precond_dim=dim, precondition_frequency=freq, amortised=False
    )
    assert opt.flops(shape, amortised=False) == per_step

    def one_step() -> int:
        return _counted(lambda: opt.direction([torch.randn(shape)], [state]))

    # Step 1 only accumulates the statistics (and eigh, not counted).
    assert one_step() == (2 * m * m * n if m <= dim else 0) + (2 * m * n * n if n <= dim else 0)
    assert one_step() == per_step  # steps 2 and 3: ordinary
    assert one_step() == per_step
    # Step 4 refreshes the bases: one k×k power-iteration product per side (QR not counted).
    assert one_step() == per_step + sum(2 * k**3 for k in sides)


class _ElementwiseFlops(TorchDispatchMode):
    """Counts elementwise FLOPs on tensors of a given size, by aten op."""

    WEIGHTS = {
        "mul": 1,
        "div": 1,
        "add": 1,
        "sub": 1,
        "sqrt": 1,
        "lerp": 3,
        "addcmul": 3,
        "addcdiv": 3,
    }
    # The non-finite guard (isfinite = x == x and |x| != inf) is a check, not optimizer arithmetic.
    GUARD = {"abs"}

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.flops, self.unknown = numel, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Boolean results belong to the non-finite guard below.
        if isinstance(out, torch.Tensor) and out.numel() == self.numel and out.is_floating_point():
            name = func.overloadpacket.__name__.rstrip("_")
            if name in self.WEIGHTS:
                self.flops += self.WEIGHTS[name] * self.numel
            elif name not in self.GUARD | {"clone", "copy", "detach", "empty", "zeros", "view"}:
                self.unknown.append(name)
        return out


def test_adamw_flops_equal_elementwise_work():
    numel = 999
    opt = AdamW()
    param, grad = torch.randn(numel), torch.randn(numel)
    state = opt.init_state(param.shape)
    with _ElementwiseFlops(numel) as counter:
        opt.step([param], [grad], [state], weight_decay=0.1)
    assert counter.unknown == []
    assert counter.flops == formulas.adamw_flops(numel) == opt.flops(param.shape)


OPTIMIZERS = {
    "muon": lambda: Muon(),
    "shampoo": lambda: Shampoo(ShampooConfig(max_preconditioner_dim=16)),
    "shampoo-momentum-plain": lambda: Shampoo(
        ShampooConfig(max_preconditioner_dim=16, momentum=0.9, grafting=None, betas=(0.0, 1.0))
    ),
    "soap": lambda: SOAP(SOAPConfig(max_precond_dim=30)),
    "adamw": lambda: AdamW(),
}


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16)])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_state_numel_equals_allocated_state(kind, shape):
    opt = OPTIMIZERS[kind]()
    state = opt.init_state(shape)
    allocated = sum(t.numel() for t in state.values())
    assert opt.state_numel(shape) == allocated
    param = torch.randn(shape)
    for _ in range(3):
        opt.step([param], [torch.randn(shape)], [state])
    assert sum(t.numel() for t in state.values()) == allocated


def test_state_numel_formulas_match_configs():
    m, n = 40, 24
    assert Muon().state_numel((m, n)) == formulas.muon_state_numel(m, n) == m * n
    assert SOAP(SOAPConfig(max_precond_dim=30)).state_numel((m, n)) == formulas.soap_state_numel(
        m, n, max_precond_dim=30
    )
    assert AdamW().state_numel((m, n)) == formulas.adamw_state_numel(m * n)
    # The default keyword values of shampoo_state_numel describe ShampooConfig's defaults.
    assert Shampoo().state_numel((m, n)) == formulas.shampoo_state_numel(m, n)
    assert formulas.SHAMPOO_DEFAULT_PRECONDITION_FREQUENCY == ShampooConfig().precondition_frequency
