import torch

from multilora.bundle import bundle, unbundle


def test_pack_roundtrip_keeps_names_keys_shapes_and_values():
    g = torch.Generator().manual_seed(0)
    adapters = {"t0": {"a.lora_A.weight": torch.randn(4, 6, generator=g), "a.lora_B.weight": torch.randn(5, 4, generator=g)},
                "s0": {"a.lora_A.weight": torch.randn(4, 6, generator=g), "a.lora_B.weight": torch.zeros(5, 4)}}
    packed = bundle(adapters)
    assert packed.flat.ndim == 1 and packed.flat.nbytes == 2 * (24 + 20) * 4 and packed.dtype == "float32"
    back = unbundle(packed)
    assert list(back) == ["t0", "s0"]
    for name in adapters:
        for key, value in adapters[name].items():
            assert torch.equal(back[name][key], value)


def test_bf16_travels_as_bytes():
    adapters = {"t0": {"k": torch.randn(3, 5).to(torch.bfloat16)}}
    back = unbundle(bundle(adapters))
    assert back["t0"]["k"].dtype == torch.bfloat16 and torch.equal(back["t0"]["k"], adapters["t0"]["k"])
