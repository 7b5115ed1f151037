"""Tests for evolution.OPERATORS and the LoRA-pair helpers (docs/design.md §4.6 contract)."""

from __future__ import annotations

import pytest
import torch

from evolution import CROSSOVERS, DEFAULT_PARAMS, MUTATIONS, OPERATORS, adapter_rank, delta_weights, layer_index, lora_pairs
from evolution.lowrank import product_svd

HIDDEN, FFN = 16, 24
MODULES = {  # module -> (parent block, in, out), SmolLM2-like proportions
    "q_proj": ("self_attn", HIDDEN, HIDDEN),
    "k_proj": ("self_attn", HIDDEN, 8),
    "v_proj": ("self_attn", HIDDEN, 8),
    "o_proj": ("self_attn", HIDDEN, HIDDEN),
    "gate_proj": ("mlp", HIDDEN, FFN),
    "up_proj": ("mlp", HIDDEN, FFN),
    "down_proj": ("mlp", FFN, HIDDEN),
}


def make_adapter(seed: int, layers: int = 3, rank: int = 4, dtype: torch.dtype = torch.float32, zero_b: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        for module, (block, d_in, d_out) in MODULES.items():
            prefix = f"base_model.model.model.layers.{i}.{block}.{module}"
            state[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) / d_in**0.5).to(dtype)
            b = torch.zeros(d_out, rank) if zero_b else torch.randn(d_out, rank, generator=g) * 0.1
            state[f"{prefix}.lora_B.weight"] = b.to(dtype)
    return state


def parents_for(name: str, seed: int = 0, **kwargs) -> list[dict[str, torch.Tensor]]:
    if name in MUTATIONS:
        return [make_adapter(seed, **kwargs)]
    return [make_adapter(seed, **kwargs), make_adapter(seed + 100, **kwargs)]


def run(name: str, parents, seed: int = 0, **params):
    return OPERATORS[name](parents, torch.Generator().manual_seed(seed), **(params or DEFAULT_PARAMS[name]))


def assert_same_dw(child, parent, atol: float = 1e-5) -> None:
    got, want = delta_weights(child), delta_weights(parent)
    assert got.keys() == want.keys()
    for prefix in want:
        err = (got[prefix] - want[prefix]).abs().max().item()
        assert err <= atol, f"{prefix}: dW differs from expected by {err:.3g} (atol {atol})"


def relative_change(child, parent) -> float:
    got, want = delta_weights(child), delta_weights(parent)
    num = sum((got[p] - want[p]).pow(2).sum() for p in want)
    den = sum(want[p].pow(2).sum() for p in want)
    return float((num / den).sqrt())


def test_registry_lists_every_operator_with_defaults():
    assert set(MUTATIONS) | set(CROSSOVERS) == set(OPERATORS)
    assert set(DEFAULT_PARAMS) == set(OPERATORS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_child_keeps_keys_shapes_dtypes_and_rank(name, dtype):
    parents = parents_for(name, dtype=dtype)
    child = run(name, parents)
    assert list(child) == list(parents[0])
    for key, value in parents[0].items():
        assert child[key].shape == value.shape, key
        assert child[key].dtype == value.dtype, key
        assert torch.isfinite(child[key].float()).all(), key
    assert adapter_rank(child) == adapter_rank(parents[0])


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_parents_untouched_and_not_aliased(name):
    parents = parents_for(name)
    before = [{k: v.clone() for k, v in p.items()} for p in parents]
    child = run(name, parents)
    for parent, saved in zip(parents, before):
        for key in saved:
            assert torch.equal(parent[key], saved[key]), f"{name} modified parent tensor {key}"
    for key, value in child.items():
        for parent in parents:
            assert value.data_ptr() != parent[key].data_ptr(), f"{name} child aliases a parent's {key}"


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_deterministic_for_a_seed(name):
    parents = parents_for(name)
    first, second = run(name, parents, seed=7), run(name, parents, seed=7)
    for key in first:
        assert torch.equal(first[key], second[key]), f"{name}: same seed gave different {key}"


@pytest.mark.parametrize("name", ["gaussian", "singular_value", "subspace_rotation", "layer_swap", "module_swap"])
def test_different_seeds_give_different_children(name):
    parents = parents_for(name)
    first, second = run(name, parents, seed=1), run(name, parents, seed=2)
    assert any(not torch.equal(first[k], second[k]) for k in first), f"{name} ignores its generator"


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutation_at_scale_zero_keeps_dw(name):
    parent = make_adapter(3)
    assert_same_dw(run(name, [parent], scale=0.0), parent)


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutation_change_grows_with_scale(name):
    parent = make_adapter(4)
    mean_change = {
        scale: sum(relative_change(run(name, [parent], seed=s, scale=scale), parent) for s in range(4)) / 4
        for scale in (0.01, 0.1, 0.5)
    }
    assert 0 < mean_change[0.01] < mean_change[0.1] < mean_change[0.5], f"{name}: change by scale {mean_change}"


def test_gaussian_is_not_a_no_op_on_a_fresh_adapter():
    fresh = make_adapter(5, zero_b=True)
    child = run("gaussian", [fresh], scale=0.1)
    assert any(d.abs().max() > 0 for d in delta_weights(child).values()), "fresh lora_B stayed zero"


def test_singular_value_keeps_singular_vectors():
    parent = make_adapter(6, dtype=torch.float64)
    child = run("singular_value", [parent], scale=0.3)
    for prefix, dw in delta_weights(parent).items():
        u = torch.linalg.svd(dw, full_matrices=False)[0][:, :4]
        new = delta_weights(child)[prefix]
        outside = new - u @ (u.T @ new)
        assert outside.norm() <= 1e-8 * new.norm(), f"{prefix}: column space moved under singular_value"


def test_subspace_rotation_keeps_spectrum_but_moves_column_space():
    parent = make_adapter(7, dtype=torch.float64)
    child = run("subspace_rotation", [parent], scale=0.3)
    for prefix, dw in delta_weights(parent).items():
        new = delta_weights(child)[prefix]
        s_old, s_new = torch.linalg.svdvals(dw), torch.linalg.svdvals(new)
        assert torch.allclose(s_old, s_new, atol=1e-10), f"{prefix}: singular values changed {s_old} -> {s_new}"
        if dw.shape[0] > 4:  # only a space smaller than the ambient one can move
            q = torch.linalg.qr(dw)[0][:, :4]
            assert (new - q @ (q.T @ new)).norm() > 1e-3 * new.norm(), f"{prefix}: column space did not move"


@pytest.mark.parametrize("name", ["layer_swap", "module_swap"])
@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_swapping_identical_parents_gives_that_parent(name, p):
    a = make_adapter(8)
    child = run(name, [a, {k: v.clone() for k, v in a.items()}], p=p)
    for key in a:
        assert torch.equal(child[key], a[key]), key


@pytest.mark.parametrize("name", ["layer_swap", "module_swap"])
def test_swap_extremes(name):
    a, b = make_adapter(9), make_adapter(10)
    for p, want in ((0.0, a), (1.0, b)):
        child = run(name, [a, b], p=p)
        for key in a:
            assert torch.equal(child[key], want[key]), f"{name} p={p}: {key} not from the expected parent"


def slot_sources(child, a, b) -> dict[str, str]:
    sources = {}
    for prefix, pair in lora_pairs(a).items():
        from_a = all(torch.equal(child[k], a[k]) for k in (pair.a_key, pair.b_key))
        from_b = all(torch.equal(child[k], b[k]) for k in (pair.a_key, pair.b_key))
        assert from_a != from_b, f"{prefix}: slot is not wholly from one parent"
        sources[prefix] = "a" if from_a else "b"
    return sources


def test_layer_swap_moves_whole_layers():
    a, b = make_adapter(11, layers=8), make_adapter(12, layers=8)
    sources = slot_sources(run("layer_swap", [a, b], seed=3, p=0.5), a, b)
    by_layer: dict[int, set[str]] = {}
    for prefix, src in sources.items():
        by_layer.setdefault(layer_index(prefix), set()).add(src)
    assert all(len(s) == 1 for s in by_layer.values()), f"a layer mixes parents: {by_layer}"
    assert {"a", "b"} == set().union(*by_layer.values()), "p=0.5 over 8 layers took every layer from one parent"


def test_module_swap_mixes_slots_within_layers():
    a, b = make_adapter(13, layers=4), make_adapter(14, layers=4)
    sources = slot_sources(run("module_swap", [a, b], seed=5, p=0.5), a, b)
    assert set(sources.values()) == {"a", "b"}


def test_svd_merge_endpoints():
    a, b = make_adapter(15, dtype=torch.float64), make_adapter(16, dtype=torch.float64)
    assert_same_dw(run("svd_merge", [a, b], weight=0.0), a, atol=1e-10)
    assert_same_dw(run("svd_merge", [a, b], weight=1.0), b, atol=1e-10)


def test_svd_merge_takes_a_lower_rank_b_exactly():
    a, b = make_adapter(17, rank=4, dtype=torch.float64), make_adapter(18, rank=2, dtype=torch.float64)
    child = run("svd_merge", [a, b], weight=1.0)
    assert adapter_rank(child) == 4
    assert_same_dw(child, b, atol=1e-10)


def test_svd_merge_half_is_best_rank_r_approximation_of_the_average():
    a, b = make_adapter(19, dtype=torch.float64), make_adapter(20, dtype=torch.float64)
    child = delta_weights(run("svd_merge", [a, b], weight=0.5))
    dw_a, dw_b = delta_weights(a), delta_weights(b)
    for prefix in dw_a:
        u, s, vh = torch.linalg.svd(0.5 * dw_a[prefix] + 0.5 * dw_b[prefix], full_matrices=False)
        best = u[:, :4] @ torch.diag(s[:4]) @ vh[:4]
        err = (child[prefix] - best).abs().max().item()
        assert err < 1e-10, f"{prefix}: differs from truncated SVD by {err:.3g}"


@pytest.mark.parametrize("name", CROSSOVERS)
def test_crossover_keeps_first_parents_rank_when_b_differs(name):
    a, b = make_adapter(21, rank=4), make_adapter(22, rank=6)
    child = run(name, [a, b], **({"p": 1.0} if name != "svd_merge" else {"weight": 1.0}))
    assert all(child[k].shape == a[k].shape for k in a)


def test_wrong_parent_count_is_a_clear_error():
    a = make_adapter(23)
    with pytest.raises(ValueError, match="exactly 1 parent"):
        run("gaussian", [a, a])
    with pytest.raises(ValueError, match="exactly 2 parents"):
        run("svd_merge", [a])


def test_crossover_rejects_mismatched_parents():
    a, b = make_adapter(24, layers=3), make_adapter(25, layers=2)
    with pytest.raises(ValueError, match="lacks"):
        run("module_swap", [a, b])


def test_lora_pairs_groups_and_orders_keys():
    state = make_adapter(26, layers=11)
    pairs = lora_pairs(state)
    assert len(pairs) == 11 * len(MODULES)
    layers = [pair.layer for pair in pairs.values()]
    assert layers == sorted(layers), "pairs are not in layer order (layers.10 before layers.2?)"
    pair = pairs["base_model.model.model.layers.3.mlp.down_proj"]
    assert (pair.module, pair.layer) == ("down_proj", 3)
    assert pair.a_key.endswith("lora_A.weight") and pair.b_key.endswith("lora_B.weight")
    del state[pair.b_key]
    with pytest.raises(ValueError, match="only lora_A"):
        lora_pairs(state)


def test_product_svd_matches_full_svd():
    g = torch.Generator().manual_seed(0)
    left, right = torch.randn(30, 5, generator=g, dtype=torch.float64), torch.randn(5, 20, generator=g, dtype=torch.float64)
    u, s, vh = product_svd(left, right)
    assert torch.allclose(u @ torch.diag(s) @ vh, left @ right, atol=1e-10)
    assert torch.allclose(s, torch.linalg.svdvals(left @ right)[:5], atol=1e-10)


@pytest.mark.parametrize("name", ["singular_value", "svd_merge"])
def test_refactoring_a_zero_delta_keeps_the_child_trainable(name):
    """A fresh adapter has B = 0; re-factoring must not zero A too (a saddle LoRA never leaves)."""
    g = torch.Generator().manual_seed(0)
    fresh = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 16, generator=g),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(12, 4)}
    params = {"singular_value": {"scale": 0.2}, "svd_merge": {"weight": 0.5}}[name]
    parents = [fresh] if name == "singular_value" else [fresh, {k: v.clone() for k, v in fresh.items()}]
    child = OPERATORS[name](parents, torch.Generator().manual_seed(1), **params)
    a = child["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = child["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.count_nonzero(b) == 0 and torch.linalg.matrix_rank(a) == 4
