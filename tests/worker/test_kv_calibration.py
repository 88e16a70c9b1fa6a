"""`worker/kv_calibration.py`: the quantized cache's key calibration at start-up."""

import pytest
import torch
from transformers import Gemma2Config

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import reference as ref
from pagedllm.models import load_model
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.worker import kv_calibration
from pagedllm.worker.kv_calibration import Moments, calibrate

from model_factory import build_hf_model, save_tiny_checkpoint
from moe_factory import save_tiny_moe_checkpoint


def _calibrate(model, tokens: int = 96):
    cfg = model.config
    return calibrate(
        model,
        dtype=torch.float32,
        device=torch.device("cpu"),
        block_size=4,
        max_model_len=40,  # windows of 40: three forwards
        tokens=tokens,
        vocab_size=cfg.vocab_size,
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("llama") / "m", "llama")
    return load_model(folder, dtype="float32", device="cpu")


def test_calibration_gives_the_same_transforms_twice(llama):
    first, second = _calibrate(llama), _calibrate(llama)
    assert first.digest == second.digest
    for a, b in zip(first.transforms, second.transforms, strict=True):
        assert torch.equal(a.scale, b.scale) and torch.equal(a.offset, b.offset)


def test_another_number_of_ids_is_another_calibration(llama):
    assert _calibrate(llama, 96).digest != _calibrate(llama, 64).digest


def test_a_heads_transform_depends_on_that_heads_moments_only():
    # what a tensor-parallel rank relies on: its heads' slice of the moments gives the slice of
    # the whole model's transform
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(50, 8, 16, generator=g), torch.randn(50, 4, 16, generator=g) + 1.0
    whole, rank1 = Moments(), Moments()
    whole.apply_(q, k)
    rank1.apply_(q[:, 4:], k[:, 2:])
    full, part = whole.transform(8, offset=True), rank1.transform(4, offset=True)
    torch.testing.assert_close(part.scale, full.scale[2:], rtol=1e-6, atol=0)
    torch.testing.assert_close(part.offset, full.offset[2:], rtol=1e-6, atol=0)
    torch.testing.assert_close(part.feedback, full.feedback[2:], rtol=1e-5, atol=1e-6)


def test_the_feedback_is_the_rotated_scaled_query_moments_pre_divided_cholesky_rows():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(300, 2, 8, generator=g) + 0.5, torch.randn(300, 1, 8, generator=g)
    m = Moments()
    m.apply_(q, k)
    t = m.transform(2, offset=True)
    # Sigma of the queries as they meet a stored row: H (q / s) / n, n = 8
    qs = q.double().reshape(-1, 8) / t.scale[0].double()
    h = ref.hadamard(torch.eye(8)).double()
    rotated = qs @ h.T / 8
    sigma = rotated.T @ rotated / 300
    damped = sigma + 0.01 * sigma.diagonal().mean() * torch.eye(8, dtype=torch.float64)
    upper = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    want = torch.triu(upper / upper.diagonal()[:, None], diagonal=1)
    want += torch.diag(1 / upper.diagonal() ** 2)
    torch.testing.assert_close(t.feedback[0].double(), want, rtol=1e-4, atol=1e-5)


def test_the_feedback_diagonal_weighs_the_coding_errors_into_the_rows_error_under_sigma():
    # the stores' scale search: coding errors e (pushed on by the rows above the diagonal) leave
    # the row off by delta = -(I + F)^T e, and delta^T Sigma delta = sum_j e_j^2 feedback[j, j]
    g = torch.Generator().manual_seed(2)
    qq = torch.randn(1, 400, 8, generator=g, dtype=torch.float64) + 0.7
    qq = qq.transpose(-1, -2) @ qq / 400
    feedback = kv_calibration.error_feedback(qq, torch.ones(1, 8, dtype=torch.float64))[0].double()
    h = ref.hadamard(torch.eye(8)).double()
    sigma = h @ qq[0] @ h / 64
    sigma += 0.01 * sigma.diagonal().mean() * torch.eye(8, dtype=torch.float64)
    e = torch.randn(8, generator=g, dtype=torch.float64)
    delta = -(torch.triu(feedback, diagonal=1) + torch.eye(8, dtype=torch.float64)).T @ e
    want = (e * e * feedback.diagonal()).sum()
    torch.testing.assert_close(delta @ sigma @ delta, want, rtol=1e-4, atol=0)


def test_the_scale_follows_the_queries_and_keeps_the_rows_energy():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(400, 1, 4, generator=g) * torch.tensor([1.0, 1.0, 4.0, 1.0])
    q = torch.randn(400, 2, 4, generator=g) * torch.tensor([1.0, 1.0, 1.0, 9.0])
    m = Moments()
    m.apply_(q, k)
    s = m.transform(2, offset=False).scale[0].double()
    k2 = (k.double() ** 2).mean(0)[0]
    q2 = (q.double() ** 2).mean((0, 1))
    want = (q2 / k2) ** 0.25
    want = want * (k2.sum() / (want**2 * k2).sum()).sqrt()
    torch.testing.assert_close(s, want, rtol=1e-6, atol=0)
    assert s[3] > s[0] > s[2]  # more precision where the queries look, less on a loud channel


def test_soft_capped_layers_get_the_scale_but_no_offset(tmp_path):
    config = Gemma2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attn_logit_softcapping=5.0,
    )
    build_hf_model(config, seed=3).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32", device="cpu")
    assert model.config.attn_softcap
    calibration = _calibrate(model)
    assert calibration.transforms and all(t.offset is None for t in calibration.transforms)


def test_layers_without_soft_capping_get_an_offset(llama):
    assert all(t.offset is not None for t in _calibrate(llama).transforms)


def test_a_mixture_of_experts_counts_no_calibration_tokens(tmp_path):
    folder = save_tiny_moe_checkpoint(tmp_path, "mixtral", seed=4)
    model = load_model(folder, dtype="float32", device="cpu")
    _calibrate(model)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(int(b.expert_tokens.sum()) == 0 for b in blocks)


def test_the_calibration_leaves_no_transform_on_the_layers(llama):
    _calibrate(llama)
    assert all(layer.self_attn.key_transform is None for layer in llama.model.layers)


def test_a_quantized_engine_is_calibrated_and_says_so(monkeypatch):
    monkeypatch.setenv(kv_calibration.ENV, "64")
    llm = LLM(kv_cache_dtype="int8", num_gpu_blocks=16, max_model_len=32)
    engine = llm.llm_engine
    calibration = engine.cache_engine.key_calibration
    assert calibration.tokens == 64
    assert engine.get_stats()["kv_key_calibration"] == "64 random token ids (seed 0)"
    layers = engine.worker.model.model.layers
    assert [layer.self_attn.key_transform for layer in layers] == list(calibration.transforms)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "env"), [("auto", None), ("int8", "0")], ids=["float_cache", "turned_off"]
)
def test_no_calibration_for_a_float_cache_or_when_turned_off(monkeypatch, kv_cache_dtype, env):
    if env is not None:
        monkeypatch.setenv(kv_calibration.ENV, env)
    llm = LLM(kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=16, max_model_len=32)
    assert llm.llm_engine.cache_engine.key_calibration is None
    assert llm.llm_engine.get_stats()["kv_key_calibration"] == "off"


def test_tensor_parallel_rank_zero_holds_its_heads_rows_of_the_one_rank_calibration(tmp_path):
    # every rank calibrates at once (Executor.start_workers): rank 0 keeps kv head 0 of 2
    folder = save_tiny_checkpoint(tmp_path / "m", "llama")
    kw = dict(kv_cache_dtype="int8", cpu_threads=1)
    one = LLM(str(folder), **kw).llm_engine.cache_engine.key_calibration
    llm = LLM(str(folder), tensor_parallel_size=2, **kw)
    two = llm.llm_engine.cache_engine.key_calibration
    llm.llm_engine.shutdown()
    assert len(two.transforms) == len(one.transforms)
    assert one.transforms[0].scale.shape[0] == 2  # kv heads, one a rank
    for mine, whole in zip(two.transforms, one.transforms):
        # the same forward, its all-reduces summed in another order: close, not bit for bit
        torch.testing.assert_close(mine.scale, whole.scale[:1], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mine.offset, whole.offset[:1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(mine.feedback, whole.feedback[:1], rtol=1e-3, atol=1e-4)


def test_a_bad_calibration_setting_is_a_value_error_naming_it(monkeypatch):
    monkeypatch.setenv(kv_calibration.ENV, "many")
    with pytest.raises(ValueError, match=kv_calibration.ENV):
        kv_calibration.calibration_tokens()


def _prompt_logprobs(monkeypatch, kv_cache_dtype: str, *, torch_path: bool, env: str = "64"):
    from pagedllm.attention import cpu_attention
    from pagedllm.models import cpu_forward

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    prompts = [[5, 9, 33, 71, 2, 8, 100, 41, 17, 3, 64, 12, 90, 7, 8, 200, 6], [11, 12, 13]]
    with monkeypatch.context() as m:
        m.setenv(kv_calibration.ENV, env)
        if torch_path:  # the torch reference's store and attention, layer by layer
            m.setattr(cpu_attention, "supports", lambda q, k_cache: False)
            m.setattr(cpu_forward, "build", lambda *args, **kwargs: None)
        llm = LLM(kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=16, max_model_len=32, block_size=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor(
        [
            step[t].logprob
            for o, p in zip(outs, prompts)
            for t, step in zip(p[1:], o.prompt_logprobs[1:])
        ]
    )


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_a_calibrated_quantized_engine_matches_the_torch_reference_path(
    monkeypatch, kv_cache_dtype
):
    engine = _prompt_logprobs(monkeypatch, kv_cache_dtype, torch_path=False)
    reference = _prompt_logprobs(monkeypatch, kv_cache_dtype, torch_path=True)
    torch.testing.assert_close(engine, reference, rtol=0, atol=1e-4)
    # and the calibration is in play: without it the quantized numbers are others
    assert not torch.equal(
        _prompt_logprobs(monkeypatch, kv_cache_dtype, torch_path=False, env="0"), engine
    )
