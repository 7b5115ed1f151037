"""The segmented training kernel (each used slot's factors on its own contiguous rows, no
per-row copies) gives the gather kernel's log-probs and gradients, forward and backward."""

from __future__ import annotations

import pytest
import torch

from multilora import layer as layer_mod
from multilora.logprobs import pad_batch, token_logprobs
from multilora.model import LoraSpec
from multilora.trainer import PolicyTrainer, TrainerSettings, TrainSample

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"))
NAMES = [f"m{i}" for i in range(9)]


@pytest.fixture(autouse=True)
def _any_shape(monkeypatch):
    """The tests' batches are short: the segmented kernel takes them whatever their size."""
    monkeypatch.setattr(layer_mod, "SEGMENTED_MIN_TOKENS_PER_SLOT", 0)


def _batch(n_adapters: int):
    """Rows grouped by adapter, groups of uneven sizes (1 to 3 rows), lengths varying."""
    g = torch.Generator().manual_seed(n_adapters)
    adapters, prompts, completions = [], [], []
    for i in range(n_adapters):
        for _ in range(1 + (i * 2) % 3):
            p, c = int(torch.randint(3, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
            ids = torch.randint(1, 1000, (p + c,), generator=g).tolist()
            adapters.append(NAMES[i])
            prompts.append(ids[:p])
            completions.append(ids[p:])
    return adapters, pad_batch(prompts, completions, 0)


def _pass(model, adapters, packed, segmented: bool, monkeypatch):
    monkeypatch.setattr(layer_mod, "SEGMENTED_TRAINING", segmented)
    model.zero_grad(set_to_none=True)
    model.invalidate()
    logp = token_logprobs(model, packed, adapters)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(7))
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("n_adapters", [1, 3, 8])
def test_fp32_gradients_equal_gather(lora_model, monkeypatch, n_adapters):
    # one more adapter than the batch uses: loaded, no rows, no gradient
    model = lora_model(SPEC, 9, NAMES[:n_adapters + 1])
    model.set_trainable(True)
    adapters, packed = _batch(n_adapters)
    calls = []
    real = layer_mod.MultiLoraLinear._add_segmented
    monkeypatch.setattr(layer_mod.MultiLoraLinear, "_add_segmented",
                        lambda self, *a: calls.append(1) or real(self, *a))
    ref_logp, ref = _pass(model, adapters, packed, False, monkeypatch)
    assert not calls
    logp, got = _pass(model, adapters, packed, True, monkeypatch)
    assert calls, "the segmented kernel did not run"
    assert _rel(logp, ref_logp) <= 1e-6
    assert got.keys() == ref.keys() and got
    # all factors' gradients together to 1e-6; a single factor's to 5e-6: summation order
    # alone moves the worst one that far (8 adapters: the gather kernel's own gradients are
    # 1.9e-6 from a float64 pass's on their worst factor, the segmented kernel's 1.9e-6)
    assert _rel(torch.cat([got[n].flatten() for n in ref]), torch.cat([ref[n].flatten() for n in ref])) <= 1e-6
    for name in ref:
        assert _rel(got[name], ref[name]) <= 5e-6, name
    used = {model.slot_of[a] for a in adapters}  # not the loaded adapter without rows
    assert model.slot_of[NAMES[n_adapters]] not in used
    assert {int(n.rsplit(".", 1)[1]) for n in got if "lora" in n} == used


@pytest.mark.parametrize("n_adapters", [1, 3, 8])
def test_bf16_gradients_equal_gather_within_rounding(lora_model, monkeypatch, n_adapters):
    model = lora_model(SPEC, 9, NAMES[:n_adapters + 1], dtype=torch.bfloat16)
    model.set_trainable(True)
    adapters, packed = _batch(n_adapters)
    ref_logp, ref = _pass(model, adapters, packed, False, monkeypatch)
    logp, got = _pass(model, adapters, packed, True, monkeypatch)
    assert got.keys() == ref.keys() and got
    # bf16 keeps 8 significant bits: two GEMM shapes round differently (2^-8 = 0.4 %
    # an entry), and the differences travel through 2 layers of backward
    assert (logp - ref_logp).abs().max() <= 0.05
    for name in ref:
        assert _rel(got[name], ref[name]) <= 3e-2, name
        assert got[name].dtype == torch.float32


@pytest.mark.parametrize("sizes", [(8,), (3, 1, 4), (1,) * 8, (2, 5, 1)])
def test_one_layer_fp32_to_1e6(sizes):
    """One layer, forward and backward: each factor's gradient, and the input's, to 1e-6."""
    g = torch.Generator().manual_seed(len(sizes))
    routing = layer_mod.Routing()
    lin = torch.nn.Linear(24, 40)
    layer = layer_mod.MultiLoraLinear(lin, 9, 4, 2.0, routing)
    with torch.no_grad():
        for p in list(layer.lora_A) + list(layer.lora_B):
            p.copy_(torch.randn(p.shape, generator=g))
    order = torch.randperm(9, generator=g)[:len(sizes)]  # slots in no particular order
    routing.slots = torch.cat([torch.full((n,), int(s)) for n, s in zip(sizes, order)])
    x0 = torch.randn(sum(sizes), 6, 24, generator=g)
    w = torch.randn(sum(sizes), 6, 40, generator=g)
    results = []
    for segmented in (False, True):
        layer_mod.SEGMENTED_TRAINING = segmented
        try:
            layer.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_(True)
            (layer(x) * w).sum().backward()
        finally:
            layer_mod.SEGMENTED_TRAINING = True
        results.append((x.grad, {i: (layer.lora_A[i].grad, layer.lora_B[i].grad) for i in range(9)
                                 if layer.lora_A[i].grad is not None}))
    (gx0, f0), (gx1, f1) = results
    assert _rel(gx1, gx0) <= 1e-6
    assert f0.keys() == f1.keys() == {int(s) for s in order}
    for i in f0:
        assert _rel(f1[i][0], f0[i][0]) <= 1e-6 and _rel(f1[i][1], f0[i][1]) <= 1e-6


def test_runs_need_contiguous_rows():
    routing = layer_mod.Routing()
    routing.slots = torch.tensor([4, 4, 1, 7, 7, 7])
    assert routing.runs() == [(1, 0, 2), (0, 2, 3), (2, 3, 6)]  # (index in used_slots, start, end)
    routing.slots = torch.tensor([4, 1, 4])
    assert routing.runs() is None
    routing.slots = torch.tensor([2])
    assert routing.runs() == [(0, 0, 1)]


def test_interleaved_rows_take_the_gather_kernel(lora_model, monkeypatch):
    model = lora_model(SPEC, 4, NAMES[:3])
    model.set_trainable(True)
    adapters, packed = ["m0", "m1", "m0", "m2"], pad_batch([[5, 6, 7], [6, 7], [7, 8, 9], [9]],
                                                          [[8, 9], [10], [11, 12, 13], [14]], 0)
    calls = []
    monkeypatch.setattr(layer_mod.MultiLoraLinear, "_add_segmented", lambda self, *a: calls.append(1))
    _pass(model, adapters, packed, True, monkeypatch)
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_form_equals_the_loop(lora_model, monkeypatch, dtype):
    """The CUDA form (`torch._grouped_mm`, which torch also runs on a CPU) against the loop."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    spec = LoraSpec(8, 16.0, SPEC.target_modules)  # rank 8: bf16 rows of 16 bytes, as it needs
    model = lora_model(spec, 9, NAMES[:4], dtype=dtype)
    model.set_trainable(True)
    adapters, packed = _batch(3)
    ref_logp, ref = _pass(model, adapters, packed, True, monkeypatch)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(layer_mod, "grouped_mm", lambda device, dtype: True)
    logp, got = _pass(model, adapters, packed, True, monkeypatch)
    assert calls, "the grouped form did not run"
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    assert _rel(logp, ref_logp) <= tol
    assert got.keys() == ref.keys() and got
    for name in ref:
        assert _rel(got[name], ref[name]) <= tol, name


def test_cast_follows_in_place_writes(lora_model):
    model = lora_model(SPEC, 2, ["m0"], dtype=torch.bfloat16)
    model.set_trainable(True)
    layer = next(iter(model.layers.values()))
    a, _ = layer._cast(0, torch.bfloat16)
    assert layer._cast(0, torch.bfloat16)[0] is a  # kept while the factors stay the same
    with torch.no_grad():
        layer.lora_A[0].add_(1.0)
    fresh, _ = layer._cast(0, torch.bfloat16)
    assert fresh is not a and torch.equal(fresh, layer.lora_A[0].detach().to(torch.bfloat16))
    layer.invalidate()
    assert not layer._casts


def test_update_equals_gather(lora_model, monkeypatch):
    """A whole update (rows of 3 adapters interleaved in the input, one adapter loaded and
    absent): the same factors after it with either kernel."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(10):
        ids = torch.randint(1, 1000, (int(torch.randint(6, 12, (1,), generator=g)),), generator=g).tolist()
        samples.append(TrainSample(NAMES[i % 3], tuple(ids[:4]), tuple(ids[4:]), float(torch.randn((), generator=g))))
    finals = []
    before = lora_model(SPEC, 5, NAMES[:4])
    before = {n: before.export_adapter(n) for n in NAMES[:4]}
    for segmented in (False, True):
        monkeypatch.setattr(layer_mod, "SEGMENTED_TRAINING", segmented)
        model = lora_model(SPEC, 5, NAMES[:4])
        trainer = PolicyTrainer(model, TrainerSettings(lr=1e-3, micro_batch=4), pad_id=0)
        stats = trainer.update(samples)
        finals.append((stats, {n: model.export_adapter(n) for n in NAMES[:4]}))
    (s0, f0), (s1, f1) = finals
    assert s0.keys() == s1.keys() == set(NAMES[:3])
    for name in s0:
        assert s1[name]["loss"] == pytest.approx(s0[name]["loss"], rel=1e-5)
        assert s1[name]["grad_norm"] == pytest.approx(s0[name]["grad_norm"], rel=1e-5)
    # Adam's first step is about lr * sign(g): an entry whose gradient is at rounding level
    # may step either way with either kernel, so the steps are compared as a whole
    for name in NAMES[:4]:
        d0 = torch.cat([(f0[name][k] - v).flatten() for k, v in before[name].items()])
        d1 = torch.cat([(f1[name][k] - v).flatten() for k, v in before[name].items()])
        if name == NAMES[3]:  # loaded, no rows: not stepped by either
            assert not d0.any() and not d1.any()
        else:
            assert _rel(d1, d0) <= 1e-3, name


def test_kernel_chosen_by_shape(monkeypatch):
    monkeypatch.setattr(layer_mod, "SEGMENTED_MIN_TOKENS_PER_SLOT", 256)
    cpu = torch.device("cpu")
    assert layer_mod.segmented_training(cpu, 1, 256)
    assert layer_mod.segmented_training(cpu, 2, 512)
    assert not layer_mod.segmented_training(cpu, 8, 8 * 64)  # one 64-token row a slot: gather
    monkeypatch.setattr(layer_mod, "SEGMENTED_TRAINING", False)
    assert not layer_mod.segmented_training(cpu, 1, 10_000)


@pytest.mark.parametrize("segmented", [False, True])
def test_kernels_equal_a_float64_autograd_reference(segmented):
    """Either kernel's gradients (to the input and to each used slot's factors) equal plain
    autograd of `x W^T + b + s (x A_row^T) B_row^T` in float64; rows of one slot interleaved
    with another's (the gather kernel then) or contiguous (the segmented one)."""
    g = torch.Generator().manual_seed(3)
    routing = layer_mod.Routing()
    lin = torch.nn.Linear(24, 40)
    layer = layer_mod.MultiLoraLinear(lin, 5, 4, 2.0, routing)
    with torch.no_grad():
        for p in list(layer.lora_A) + list(layer.lora_B):
            p.copy_(torch.randn(p.shape, generator=g))
    slots = [1, 3, 3, 4, 4, 4] if segmented else [3, 1, 3, 4, 1, 4]
    routing.slots = torch.tensor(slots)
    x0 = torch.randn(len(slots), 6, 24, generator=g)
    w = torch.randn(len(slots), 6, 40, generator=g)
    layer_mod.SEGMENTED_TRAINING = segmented
    try:
        x = x0.clone().requires_grad_(True)
        (layer(x) * w).sum().backward()
    finally:
        layer_mod.SEGMENTED_TRAINING = True
    assert (routing.runs() is not None) == segmented
    xr = x0.double().requires_grad_(True)
    factors = {s: (layer.lora_A[s].detach().double().requires_grad_(True),
                   layer.lora_B[s].detach().double().requires_grad_(True)) for s in set(slots)}
    rows = [xr[i] @ lin.weight.double().T + lin.bias.double()
            + 2.0 * (xr[i] @ factors[s][0].T) @ factors[s][1].T for i, s in enumerate(slots)]
    (torch.stack(rows) * w.double()).sum().backward()
    assert _rel(x.grad, xr.grad) <= 1e-6
    for s, (a, b) in factors.items():
        assert _rel(layer.lora_A[s].grad, a.grad) <= 1e-6 and _rel(layer.lora_B[s].grad, b.grad) <= 1e-6
        assert layer.lora_A[s].grad.dtype == torch.float32
    assert all(layer.lora_A[s].grad is None for s in range(5) if s not in factors)
