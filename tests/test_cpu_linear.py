"""Packed oneDNN linear layers on CPU (`hf_paged.kernels.cpu_linear`) against plain ``F.linear``."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hf_paged.kernels.cpu_linear import PrepackedLinear, available, prepack_linear_layers, unpack_linear_layers
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN linear")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(48, 96)
        self.down = nn.Linear(96, 48, bias=False)
        self.custom = CustomLinear(48, 8)

    def forward(self, x):
        return self.custom(self.down(torch.relu(self.up(x))))


class CustomLinear(nn.Linear):
    """Stands in for quantized layers: a subclass of nn.Linear that must be left alone."""


def test_prepack_swaps_only_plain_linear_layers_and_keeps_the_state_dict():
    torch.manual_seed(0)
    block = Block()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    assert prepack_linear_layers(block) == 2
    assert type(block.up) is PrepackedLinear and type(block.down) is PrepackedLinear
    assert type(block.custom) is CustomLinear
    assert isinstance(block.up, nn.Linear)
    after = block.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert block.up._packed.layout == torch._mkldnn

    assert unpack_linear_layers(block) == 2
    assert type(block.up) is nn.Linear and "_packed" not in vars(block.up)


def test_layers_kept_plain_are_left_alone():
    block = Block()
    assert prepack_linear_layers(block, keep_plain=[block.down]) == 1
    assert type(block.up) is PrepackedLinear and type(block.down) is nn.Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48)])
def test_packed_forward_matches_f_linear(dtype, shape):
    if not available(dtype):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    torch.manual_seed(0)
    layer = nn.Linear(48, 96).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    prepack_linear_layers(layer)
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_non_contiguous_and_empty_inputs():
    torch.manual_seed(0)
    layer = nn.Linear(48, 96)
    prepack_linear_layers(layer)
    inputs = [torch.randn(48, 5).t(), torch.randn(3, 10, 48)[:, ::2], torch.randn(0, 48)]
    with torch.inference_mode():
        for x in inputs:
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_packed_copy_follows_weight_changes():
    torch.manual_seed(0)
    layer = nn.Linear(48, 96)
    prepack_linear_layers(layer)
    x = torch.randn(4, 48)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place, as an optimizer or load_state_dict does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(96, 48))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_other_dtypes_fall_back_to_f_linear():
    torch.manual_seed(0)
    layer = nn.Linear(48, 96)
    prepack_linear_layers(layer)
    layer.double()
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_packed_layers_copy_and_pickle():
    torch.manual_seed(0)
    block = Block()
    prepack_linear_layers(block)
    buffer = io.BytesIO()
    torch.save(block, buffer)
    buffer.seek(0)
    x = torch.randn(3, 48)
    for twin in (copy.deepcopy(block), torch.load(buffer, weights_only=False)):
        assert type(twin.up) is PrepackedLinear
        with torch.inference_mode():
            torch.testing.assert_close(twin(x), block(x))
        assert twin.up._packed is not block.up._packed
    fresh = copy.deepcopy(block)  # never ran: no packed copy of its own yet
    assert unpack_linear_layers(fresh) == 2


def test_layers_onednn_cannot_take_stay_plain():
    class Wrapped(torch.Tensor):  # stands in for quantized weight tensors (torchao and the like)
        pass

    layer = nn.Linear(48, 96)
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Wrapped))
    assert prepack_linear_layers(layer) == 0 and type(layer) is nn.Linear


def test_a_weight_onednn_cannot_pack_runs_f_linear(monkeypatch):
    """As bf16 on CPUs without AVX-512 or AVX-NE-CONVERT after ``model.to(torch.bfloat16)``: the reorder raises, the
    layer stays usable, and prepacking leaves such layers plain."""
    torch.manual_seed(0)
    layer, x = nn.Linear(48, 96), torch.randn(12, 48)  # 12 rows: past the native kernel, to oneDNN's path
    prepack_linear_layers(layer)

    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: this CPU cannot")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    with torch.no_grad():
        layer.weight.mul_(2)  # a new version: packed again
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._packed is None
    other = nn.Linear(48, 96)
    assert prepack_linear_layers(other) == 0 and type(other) is nn.Linear and "_packed_from" not in other.__dict__


def test_autocast_and_inference_mode_weights():
    with torch.inference_mode():
        layer = nn.Linear(48, 96)  # an inference tensor: no version counter
    assert prepack_linear_layers(layer) == 1
    x = torch.randn(4, 48)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(x).dtype == torch.bfloat16  # as F.linear under autocast


def test_training_forward_falls_back_to_autograd():
    torch.manual_seed(0)
    layer = nn.Linear(48, 96)
    reference = nn.Linear(48, 96)
    reference.load_state_dict(layer.state_dict())
    prepack_linear_layers(layer)
    x = torch.randn(4, 48)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_model_logits_match_after_prepacking():
    model, _ = tiny_model("llama", attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.inference_mode():
        expected = model(ids).logits
        assert prepack_linear_layers(model) > 0
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
