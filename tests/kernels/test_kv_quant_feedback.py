"""The stored keys' error-feedback rounding (`kernels.reference.quantize_rows(..., feedback)`, the
key calibration's matrices): no feedback matrix entries, no change; a real Sigma's feedback puts
less error where the queries look than nearest rounding; the Rust store (`cpu_store_kvcache`'s
`key_feedback`, every ISA level through `tests/lower_isa_levels.py`) codes the keys bit for bit
as the reference and leaves the values as they were."""

import numpy as np
import pytest
import torch

from pagedllm import _core
from pagedllm.attention.cpu_attention import _cache_view
from pagedllm.kernels import reference as ref
from pagedllm.kernels.cpu_arrays import numpy_view
from pagedllm.worker.kv_calibration import error_feedback

FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ALL_FORMATS = pytest.mark.parametrize("kv_dtype", list(FORMATS))
KVH, D = 3, 64


def _keys(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, KVH, D, generator=g) * torch.logspace(-2, 2, n)[:, None, None]
    x[n // 2] = 0
    return x


def _sigma(seed: int) -> torch.Tensor:
    """Queries' second moments `[KVH, D, D]` with a shared mean direction (as real ones)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(KVH, 500, D, generator=g, dtype=torch.float64)
    q = q + 3.0 * torch.randn(KVH, 1, D, generator=g, dtype=torch.float64)
    return q.transpose(-1, -2) @ q / 500


def _feedback(seed: int = 7) -> torch.Tensor:
    return error_feedback(_sigma(seed), torch.ones(KVH, D, dtype=torch.float64))


@ALL_FORMATS
def test_a_zero_feedback_gives_the_nearest_codes(kv_dtype):
    x = _keys(16, seed=1)
    zero = torch.zeros(KVH, D, D)
    got = ref.quantize_rows(x, FORMATS[kv_dtype], zero).view(torch.uint8)
    assert torch.equal(got, ref.quantize_rows(x, FORMATS[kv_dtype]).view(torch.uint8))


@ALL_FORMATS
def test_feedback_puts_less_error_where_the_queries_look_than_nearest_rounding(kv_dtype):
    x, sigma = _keys(200, seed=2), _sigma(7)
    # the error as the queries meet it: the rotated row's, weighed by the rotated Sigma
    h = ref.hadamard(torch.eye(D)).double()
    rotated = h @ sigma @ h / D**2

    def weighed(rows: torch.Tensor) -> float:
        delta = ref.hadamard(ref.dequantize_rows(rows) - x).double()
        return torch.einsum("tkd,kde,tke->", delta, rotated, delta).item()

    nearest = weighed(ref.quantize_rows(x, FORMATS[kv_dtype]))
    fed = weighed(ref.quantize_rows(x, FORMATS[kv_dtype], _feedback()))
    assert fed < 0.8 * nearest


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_key_scale_search_keeps_the_candidate_byte_of_least_weighted_error(kv_dtype):
    # a diagonal feedback (no error pushed on, weights w): each candidate byte codes the row by
    # nearest rounding, its error sum_j w_j (code_j scale - y_j)^2 computed here
    cache_dtype, x = FORMATS[kv_dtype], _keys(64, seed=5)[:, :1]
    weights = torch.rand(1, D, generator=torch.Generator().manual_seed(6)) + 0.5
    rows = ref.quantize_rows(x, cache_dtype, torch.diag_embed(weights)).view(torch.uint8)
    first = ref.quantize_rows(x, cache_dtype).view(torch.uint8)[..., -1:].long()
    y, limit = ref.hadamard(x), ref.kv_code_max(cache_dtype)
    errors = []
    for k in range(ref.KEY_BYTES):
        scale = ref._row_scale((first + k).clamp(max=255), cache_dtype)
        codes = (y / scale).clamp(-limit, limit)
        codes = codes.round() if cache_dtype == torch.int8 else codes.to(cache_dtype).float()
        errors.append(((codes * scale - y).double() ** 2 * weights.double()).sum(-1))
    errors = torch.stack(errors)
    chosen = rows[..., -1].long() - first[..., 0]
    assert ((chosen >= 0) & (chosen < ref.KEY_BYTES)).all()
    assert (errors.gather(0, chosen[None])[0] <= errors.min(0).values * (1 + 1e-5)).all()
    assert (chosen > 0).sum() >= 8, "a search that never moves tests nothing"


def test_int8_keys_keep_the_smallest_bound_byte_under_feedback():
    x = _keys(64, seed=5)
    rows = ref.quantize_rows(x, torch.int8, _feedback()).view(torch.uint8)
    assert torch.equal(rows[..., -1], ref.quantize_rows(x, torch.int8).view(torch.uint8)[..., -1])


def _rust_store(x, kv_dtype, feedback):
    shape = (len(x), 1, KVH, D + 1)
    kc, vc = (torch.zeros(shape, dtype=FORMATS[kv_dtype]) for _ in range(2))
    slots = np.arange(len(x), dtype=np.int64)
    fb = None if feedback is None else feedback.numpy()
    kv = numpy_view(x)
    _core.cpu_store_kvcache(kv, kv, _cache_view(kc), _cache_view(vc), slots, kv_dtype, fb)
    return kc[:, 0].view(torch.uint8), vc[:, 0].view(torch.uint8)


@ALL_FORMATS
def test_the_rust_store_codes_keys_with_feedback_bit_for_bit_as_the_reference(kv_dtype):
    x, feedback = _keys(40, seed=3), _feedback()
    keys, values = _rust_store(x, kv_dtype, feedback)
    assert torch.equal(keys, ref.quantize_rows(x, FORMATS[kv_dtype], feedback).view(torch.uint8))
    assert torch.equal(values, ref.quantize_rows(x, FORMATS[kv_dtype]).view(torch.uint8))


def test_a_key_feedback_of_the_wrong_size_is_a_value_error():
    with pytest.raises(ValueError, match="key_feedback"):
        _rust_store(_keys(4, seed=4), "int8", torch.zeros(KVH, D, D - 1))
