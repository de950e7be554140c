"""The lean step's quantized kernels (model/cpu_quant.py): what a decode step of a 4-bit
or int8 model computes, against the exact product of the weights the layer stands for."""

import pytest
import torch

from conftest import get_engine, torch_threads
from tierserve.model import kernels
from tierserve.model.quant import GROUP_SIZE, QuantLinear, int8_linear

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C++ toolchain")


def _int4_layer(n: int, k: int, seed: int, group: int = GROUP_SIZE, codes=None):
    """A random 4-bit layer and the exact float64 weight [N, K] it holds."""
    gen = torch.Generator().manual_seed(seed)
    if codes is None:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) / 8
    minimum = -torch.rand(n, k // group, generator=gen)
    layer = QuantLinear.int4(codes, scale, minimum)
    # what the layer keeps: s and z in bfloat16, w = s q + (z - 8 s)
    s, z = layer.scales[..., 0].double().t(), layer.scales[..., 1].double().t()   # [N, K/g]
    w = codes.double() * s.repeat_interleave(group, 1) \
        + (z - 8 * s).repeat_interleave(group, 1)
    return layer, w


def _within_int8_rounding(got, x, w, group: int) -> bool:
    """|got - x w^T| within what rounding x to int8 per group and the output once allow."""
    exact = x.double() @ w.t()
    d = x.double().view(x.shape[0], -1, group).abs().amax(-1) / 127               # [M, groups]
    w_abs = w.abs().view(w.shape[0], -1, group).sum(-1)                          # [N, groups]
    bound = (d / 2) @ w_abs.t() + exact.abs() * 2**-8 + 1e-6
    return bool(((got.double() - exact).abs() <= bound).all())


vnni = pytest.mark.skipif(not getattr(kernels.load(), "int4_kernel", False),
                          reason="the 4-bit kernel needs AVX-512 VNNI or AVX2")
avx2_only = pytest.mark.skipif(not getattr(kernels.load(), "int4_kernel", False)
                               or getattr(kernels.load(), "int4_vnni", True),
                               reason="float32 and block-ordered scales: the AVX2 kernel only")


@vnni
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 96, 300])
def test_4_bit_products_are_exact_up_to_int8_inputs_and_one_rounding(rows):
    """The kernel may round each input to int8 per group of 32 (d = max|x| / 127, as
    llama.cpp's 4-bit dot products do), so each output may be off by at most
    sum over groups of d/2 * sum |w| there, plus the final bfloat16 rounding."""
    layer, w = _int4_layer(192, 8 * GROUP_SIZE, seed=rows)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(7)).bfloat16()
    got = kernels.load().int4_matmul(x, layer.weight, layer.scales, layer.group_size).double()
    exact = x.double() @ w.t()
    d = x.double().view(rows, -1, GROUP_SIZE).abs().amax(-1) / 127               # [M, groups]
    w_abs = w.abs().view(w.shape[0], -1, GROUP_SIZE).sum(-1)                    # [N, groups]
    bound = (d / 2) @ w_abs.t() + exact.abs() * 2**-8 + 1e-6
    assert ((got - exact).abs() <= bound).all()
    # and far closer than that bound in practice: a typical error under 1% of the output
    assert float((got - exact).norm() / exact.norm()) < 0.01


@vnni
@pytest.mark.parametrize("group", [GROUP_SIZE, 48, 64])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 15, 16, 41, 144])
def test_a_rows_4_bit_product_does_not_depend_on_the_rows_beside_it(rows, group):
    """With AVX-512 VNNI the kernel takes 1-4 rows, tiles under 16 rows and larger tiles
    by three different loops; with AVX2 by four: one row, two to four (for groups of 32
    with inputs paired in 16-bit lanes), and from 5 with outputs in lanes, 64 rows a pass,
    its int16 sums widened every 32 inputs. Each row's outputs are the same bits in all
    of them, so a request's tokens do not depend on how many others share its step."""
    layer, w = _int4_layer(192, 48 * GROUP_SIZE, seed=rows, group=group)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    k = kernels.load()
    together = k.int4_matmul(x, layer.weight, layer.scales, layer.group_size)
    for r in {0, rows // 2, rows - 1}:
        alone = k.int4_matmul(x[r:r + 1].contiguous(), layer.weight, layer.scales,
                              layer.group_size)
        assert torch.equal(together[r:r + 1], alone)


@vnni
@pytest.mark.parametrize("blocks", [3, 4, 5])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 24, 64, 260])
def test_a_4_bit_product_is_the_same_bits_on_any_number_of_threads(blocks, rows):
    """Threads share the packing's blocks (64 outputs with AVX-512 VNNI, 32 with AVX2) by
    halves (VNNI: a block's first and last 32 outputs at 1-4 rows, its rows above that;
    AVX2: its first and last 16 outputs at any rows), so that two threads split 3 or 5
    blocks evenly; a shared block's outputs must be the bits one thread computes alone
    (VNNI at 24 rows: a half goes to the group-at-a-time loop where the whole tile takes
    the block at once; 260 rows are three tiles; AVX2 from 5 rows: the block unpacked
    first)."""
    # torch's packing holds 64 outputs a block with AVX-512, 32 with AVX2
    outputs = blocks * (64 if getattr(kernels.load(), "int4_vnni", False) else 32)
    layer, w = _int4_layer(outputs, 12 * GROUP_SIZE, seed=outputs + rows)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(5)).bfloat16()
    k, results = kernels.load(), []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            results.append(k.int4_matmul(x, layer.weight, layer.scales, layer.group_size))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    exact = x.double() @ w.t()
    assert float((results[0].double() - exact).norm() / exact.norm()) < 0.01


@avx2_only
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_an_avx2_4_bit_product_in_float32_is_the_bfloat16_one_before_its_rounding(rows):
    """Where bfloat16 does not compute (AVX2), x and the scales may be float32: the same
    int8 inputs and sums, so the float32 outputs round to the bfloat16 ones exactly."""
    layer, w = _int4_layer(128, 6 * GROUP_SIZE, seed=rows)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(9)).bfloat16()
    k = kernels.load()
    half = k.int4_matmul(x, layer.weight, layer.scales, layer.group_size)
    full = k.int4_matmul(x.float(), layer.weight, layer.scales.float(), layer.group_size)
    assert full.dtype == torch.float32 and torch.equal(full.bfloat16(), half)


@avx2_only
@pytest.mark.parametrize("group", [GROUP_SIZE, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70])
def test_an_avx2_4_bit_product_is_the_same_bits_with_its_scales_in_block_order(rows, group):
    """The lean step hands the AVX2 kernel each layer's (s, z) pairs in block order (one
    stream a block); the products are those of torch's order, bfloat16 and float32 pairs,
    in the one-to-four-row loop and the wide one (a row count that is neither a multiple of
    two nor of four), with a block split between the two threads (five blocks), float32
    outputs (no rounding to hide a difference) and more groups than are read ahead."""
    layer, _ = _int4_layer(160, 10 * group, seed=rows, group=group)
    x = torch.randn(rows, 10 * group, generator=torch.Generator().manual_seed(3))
    k = kernels.load()
    for scales in (layer.scales, layer.scales.float()):
        ordered = k.int4_blocked_scales(scales)
        assert ordered.shape == (160 // 32, 10, 32, 2)
        with torch_threads(2):
            assert torch.equal(k.int4_matmul(x, layer.weight, ordered, group),
                               k.int4_matmul(x, layer.weight, scales, group))
    with pytest.raises(RuntimeError, match="not torch's CPU int4 packing"):
        k.int4_matmul(x, layer.weight, k.int4_blocked_scales(layer.scales)[:4], group)


@vnni
@pytest.mark.parametrize("group", [16, 64])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_4_bit_products_hold_for_other_group_sizes(group, rows):
    """Groups of 16 to 64 inputs (GGUF's 4-bit formats have 32): the same bound."""
    layer, w = _int4_layer(128, 4 * 64, seed=group + rows, group=group)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    got = kernels.load().int4_matmul(x, layer.weight, layer.scales, layer.group_size)
    assert layer.group_size == group and _within_int8_rounding(got, x, w, group)


@vnni
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [1, 4, 6])
def test_the_largest_4_bit_sums_do_not_overflow(rows, group):
    """Every code 15 and every input at the group's largest magnitude: the integer sums
    are at their largest (the AVX2 kernel sums 32 inputs in int16; at two to four rows
    and groups of 32, 16 products in each 16-bit lane; at 6 rows, four rows in one
    pass)."""
    codes = torch.full((64, 2 * 64), 15, dtype=torch.uint8)
    layer, w = _int4_layer(64, 2 * 64, seed=rows, group=group, codes=codes)
    x = torch.full((rows, w.shape[1]), -3.0).bfloat16()
    x[:, 64:] = 2.5
    got = kernels.load().int4_matmul(x, layer.weight, layer.scales, layer.group_size)
    exact = x.double() @ w.t()
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-6).all()


@vnni
def test_4_bit_products_of_an_all_zero_group_are_exact():
    layer, w = _int4_layer(64, 4 * GROUP_SIZE, seed=11)
    x = torch.zeros(2, w.shape[1]).bfloat16()
    x[0, 5], x[1, 70] = 1.0, -0.25                  # one input each: nothing to round
    got = kernels.load().int4_matmul(x, layer.weight, layer.scales, layer.group_size).double()
    exact = x.double() @ w.t()
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + 1e-9).all()


@pytest.mark.parametrize("rows", [1, 5, 32, 100])
def test_int8_products_agree_with_torchs_kernel(rows):
    gen = torch.Generator().manual_seed(rows)
    # 321 outputs: the kernel takes weight rows in pairs, and the odd last one alone
    layer = int8_linear(torch.randn(321, 576, generator=gen), None, torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    got = kernels.load().int8_matmul(x, layer.weight, layer.scales).float()
    want = torch.ops.aten._weight_int8pack_mm(x, layer.weight, layer.scales).float()
    # both sum in float32 and round once to bfloat16 (torch after the scale, in bf16)
    assert ((got - want).abs() <= want.abs() * 2**-6 + 1e-3).all()


int8_vnni = pytest.mark.skipif(
    not getattr(kernels.load(), "int4_kernel", False) or (
        not getattr(kernels.load(), "int8_vnni", False)
        and not getattr(kernels.load(), "int8_avx2", False)),
    reason="the int8 head kernel on integer dots needs AVX-512 VNNI and BF16, or AVX2, "
           "and the 4-bit kernel (whose rounding of x it shares)")


def _rounded_head(kernel, x, weight, scales):
    """The head on integer dots this CPU has: AVX-512 VNNI's (weights repacked) or AVX2's."""
    if getattr(kernel, "int8_vnni", False):
        return kernel.int8_matmul_vnni(x, kernel.pack_int8_vnni(weight), scales, weight.shape[0])
    return kernel.int8_matmul_avx2(x, kernel.pack_int8_avx2(weight), scales, weight.shape[0])


# AVX2's packing takes any number of outputs (a last partial tile of 16 padded); VNNI's
# takes multiples of 32, and set_head keeps other heads off it
_HEAD_OUTPUTS = [320] if getattr(kernels.load(), "int8_vnni", False) else [320, 327]


@int8_vnni
@pytest.mark.parametrize("outputs", _HEAD_OUTPUTS)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 64])
def test_the_int8_head_on_integer_dots_is_exact_up_to_int8_inputs_and_one_rounding(rows, outputs):
    """The lm_head's integer kernel rounds x to int8 per group of 32 as the 4-bit kernel
    does; its error is bounded the same way, and it reads the same layer as int8_matmul."""
    gen = torch.Generator().manual_seed(rows)
    layer = int8_linear(torch.randn(outputs, 576, generator=gen), None, torch.bfloat16)
    w = layer.weight.double() * layer.scales.double()[:, None]                 # [N, K]
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    kernel = kernels.load()
    got = _rounded_head(kernel, x, layer.weight, layer.scales).double()
    exact = x.double() @ w.t()
    d = x.double().view(rows, -1, GROUP_SIZE).abs().amax(-1) / 127
    w_abs = w.abs().view(w.shape[0], -1, GROUP_SIZE).sum(-1)
    bound = (d / 2) @ w_abs.t() + exact.abs() * 2**-8 + 1e-6
    assert ((got - exact).abs() <= bound).all()
    assert float((got - exact).norm() / exact.norm()) < 0.01


@pytest.mark.skipif(not getattr(kernels.load(), "int8_avx2", False),
                    reason="the AVX2 int8 head kernel (AVX2 without AVX-512 VNNI)")
@pytest.mark.parametrize("rows", [1, 6])
def test_the_avx2_head_takes_its_scales_made_once_with_the_same_bits(rows):
    """The lean step keeps the AVX2 head's scales as the kernel reads them (float32, padded
    with zeros to whole tiles of 16); given so, the kernel gives the bits it gives from the
    layer's own bfloat16 scales. Any other count of scales is refused."""
    gen = torch.Generator().manual_seed(rows)
    layer = int8_linear(torch.randn(327, 576, generator=gen), None, torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    kernel = kernels.load()
    packed = kernel.pack_int8_avx2(layer.weight)
    padded = torch.cat([layer.scales.float(), torch.zeros(9)])          # 336: 21 tiles
    want = kernel.int8_matmul_avx2(x, packed, layer.scales, 327)
    assert torch.equal(kernel.int8_matmul_avx2(x, packed, padded, 327), want)
    with pytest.raises(RuntimeError, match="scales"):
        kernel.int8_matmul_avx2(x, packed, padded[:330], 327)


@int8_vnni
def test_an_int8_head_that_fits_runs_on_integer_dots_in_the_lean_step():
    """What set_head decides: the 4-bit model's int8 head gives the integer kernel's logits."""
    runner = get_engine(dtype="bfloat16", quantization="gguf").runner
    head = runner.model.lm_head
    hidden = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(1))
    hidden = hidden.bfloat16()
    kernel = kernels.load()
    want = _rounded_head(kernel, hidden, head.weight, head.scales).float()
    assert torch.equal(runner.lean.logits(hidden), want)


@int8_vnni
def test_a_weight_only_int8_model_keeps_its_heads_input_in_bfloat16():
    """int8 is weight-only: its head must not round x to int8 as the 4-bit body's does
    (rounded, greedy text moved off bfloat16's on 21 of 80 tokens of test_quant's prompts)."""
    runner = get_engine(dtype="bfloat16", quantization="int8").runner
    head = runner.model.lm_head
    hidden = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(1))
    hidden = hidden.bfloat16()
    kernel = kernels.load()
    rounded = _rounded_head(kernel, hidden, head.weight, head.scales).float()
    want = kernel.int8_matmul(hidden, head.weight, head.scales).float()
    got = runner.lean.logits(hidden)
    assert torch.equal(got, want) and not torch.equal(got, rounded)
