"""LoRA injection and the saved key layout ComfyUI loads."""
import torch
from torch import nn

from pipetrain.backend.adapters import injection


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)


def test_inject_targets_only_block_linears_and_freezes_the_rest():
    net = Net()
    names = injection.inject(net, injection.AdapterSpec(rank=2, alpha=4.0), ("blocks",), patterns=[r"qkv$"])
    assert names == ["blocks.0.qkv", "blocks.1.qkv"]
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable == ["blocks.0.qkv.lora_A.weight", "blocks.0.qkv.lora_B.weight",
                         "blocks.1.qkv.lora_A.weight", "blocks.1.qkv.lora_B.weight"]


def test_forward_adds_scaled_low_rank_update():
    net = Net()
    x = torch.randn(3, 8)
    base = net.blocks[0].qkv(x)
    injection.inject(net, injection.AdapterSpec(rank=2, alpha=4.0), ("blocks",))
    m = net.blocks[0].qkv
    assert torch.equal(m(x), base)  # B starts at zero
    m.lora_B.weight.data.normal_()
    expected = base + 2.0 * x @ m.lora_A.weight.T @ m.lora_B.weight.T
    assert torch.allclose(m(x), expected, atol=1e-6)


def test_saved_keys_are_comfyui_keys_and_roundtrip(tmp_path):
    net = Net()
    injection.inject(net, injection.AdapterSpec(rank=2, alpha=3.0, seed=5), ("blocks",))
    sd = injection.state_dict(net)
    assert set(sd) == {f"diffusion_model.blocks.{i}.{m}.{k}" for i in (0, 1) for m in ("qkv", "proj")
                       for k in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert float(sd["diffusion_model.blocks.0.qkv.alpha"]) == 3.0
    path = tmp_path / "x.safetensors"
    injection.save_file(sd, path, injection.metadata_for({"rank": 2}))
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary left behind
    other = Net()
    injection.inject(other, injection.AdapterSpec(rank=2, alpha=3.0, seed=6), ("blocks",))
    assert injection.load_into(other, injection.read_file(path)) == 4
    assert torch.equal(other.blocks[1].proj.lora_A.weight, net.blocks[1].proj.lora_A.weight)


def test_initialisation_depends_on_seed_and_module_name_only():
    a, b = Net(), Net()
    injection.inject(a, injection.AdapterSpec(rank=2, alpha=2.0, seed=1), ("blocks",))
    injection.inject(b, injection.AdapterSpec(rank=2, alpha=2.0, seed=1), ("blocks.1",))
    assert torch.equal(a.blocks[1].qkv.lora_A.weight, b.blocks[1].qkv.lora_A.weight)
