"""Candidate KV row formats measured before building them: the model runs with its float cache,
layer by layer (`enforce_eager`), and each layer's new keys and values are coded and decoded in
torch by the candidate scheme just before the store, so every position attends over keys and
values as the scheme would give them back. Teacher-forced over real text as
`kv_quant_quality.py`: the share of positions whose top-1 token equals the float cache's, and
the perplexity against the float cache's.

    python benches/kv_quant_schemes.py --tokens 4096 [--text FILE] \
        --schemes engine-int8 int8-b3 int8-b5 int8-exact int8-mse int8-b3-konly fp8-b3 fp8-b3-norot

A scheme is `KIND-BOUND[-norot][-konly|-vonly]`: KIND int8 (symmetric, max 127) or fp8
(e4m3fn, max 448); BOUND how the row's bound (scale x max) is kept: `b3` / `b4` / `b5` its amax
rounded up to 3 / 4 / 5 mantissa bits (`b3` is round 5's scale byte), `lg16` / `lg20` / `lg24` its
amax rounded up to a power of 2^(1 / 16) (/ 20 / 24); `@F` after one of these keeps the bound
within the 256 values a byte codes from 2^F up (`m2`: -2); `exact` the amax as a float, `mse`
the bound among 1.0 .. 0.7 x amax with the row's least squared error, `b3mse` among
the scale byte's bound and the three bytes below it; `norot` codes the row
without the Walsh-Hadamard rotation, `rs` flips a fixed random set of its channels' signs
first; `kc` codes the keys less their mean over the window's positions (an upper bound of
a per-(layer, head) key offset), `calN` the keys less an offset fixed beforehand: their mean
over the N-th `--calibration` source (another text, `FILE[:TOKENS]`, or `random:TOKENS` token
ids from a fixed seed), per layer and kv head; `konly` / `vonly` codes only the keys / values.
`engine-int8` and `engine-fp8` are `kernels.reference`'s coding (the shipped format, for a check
against b3); the offset flags apply to them too (`engine-int8-cal0`). Channel scaling before
the rotation (`k' = H S k`, the query met as `H S^-1 q`: scores exact): `sN` scales the keys by
S from the N-th `--calibration` source's moments, `s_c = (E q_c^2 / E k_c^2)^(p / 2)` (`eP`:
p = P / 100, default 50), `sw` from the coded window's own (an upper bound), `sx` from the
weights alone (q_proj / k_proj rows times the layer norm's weights; a safetensors `--model`);
`tie` one factor a RoPE pair (geometric mean), `tie2` from the pair's summed moments (then S
commutes with RoPE and could fold into the projections); `vN` / `vw` scale the values by the
output projection's column norms against their moments. `bf16-x` / `fp16-x`: the rows only
rounded to a 16-bit float (the metric's floor). Each result also counts how many flips were
float near-ties (top-1 / top-2 logprob margin below 0.01 / 0.05 / 0.1) and the agreement over
the other positions.

Error-feedback rounding of the keys (`gN`, GPTQ / OBQ's update): a stored key row's score error
over the queries is `q' . delta` (`q'` the query as it meets the rotated, S-scaled row, `delta`
the row's rounding error), of expected square `delta^T Sigma delta`, `Sigma = E q' q'^T` of the kv
head's queries from the N-th `--calibration` source (pooled over its query heads, in the basis the
row is stored in: S and the rotation of the scheme's other flags). The row's channels are rounded
one by one, each one's error pushed onto the channels not yet rounded through the upper Cholesky
factor of `Sigma^-1` (damped by 1 % of its mean diagonal): the nearest plane rather than the
nearest point. `gNo` rounds the channels in decreasing order of Sigma's diagonal (GPTQ's act
order). The scale byte is the shipped one (the unperturbed row's amax). Each `g` result also
reports Sigma's spectrum per layer: the off-diagonal share of its Frobenius norm, the largest /
four largest eigenvalues' share of its trace, and the predicted ratio of the feedback's expected
score error to rounding to nearest (`sum 1 / U_jj^2 / trace Sigma` under uniform rounding errors).

    python benches/kv_quant_schemes.py --model /work/models/kvq-smollm2-f32 --text FILE \
        --calibration OTHER_FILE random:1024 --schemes engine-int8 engine-int8-kc engine-int8-cal0
    python benches/kv_quant_schemes.py --model /work/models/kvq-smollm2-f32 --text FILE \
        --calibration random1:4096 --schemes engine-fp8-cal0-s0 engine-fp8-cal0-s0-g0
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from kv_quant_quality import TEXT

from pagedllm import LLM, SamplingParams
from pagedllm.attention import cpu_attention
from pagedllm.kernels import reference

_TIES = (0.01, 0.05, 0.1)
_CLIPS = [1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76, 0.73, 0.7]
_MAX = {"int8": 127.0, "fp8": 448.0}
# how many rows (rotated) a scheme met per octave of their amax, keys and values apart: the range
# a scale byte must cover
_OCTAVES: dict = {"k": {}, "v": {}}


def round_up(amax: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """`amax` (float32 > 0) rounded up to `mantissa_bits` bits of mantissa."""
    shift = 23 - mantissa_bits
    bits = ((amax.view(torch.int32).long() + (1 << shift) - 1) >> shift) << shift
    return bits.int().view(torch.float32)


def log_up(amax: torch.Tensor, steps: int) -> torch.Tensor:
    """`amax` rounded up to a power of 2^(1 / steps) (a log-spaced scale byte)."""
    return torch.exp2(torch.ceil(torch.log2(amax.double()) * steps - 1e-9) / steps).float()


def code(y: torch.Tensor, bound: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows `y` coded with their bound and decoded."""
    scale = bound / _MAX[kind]
    if kind == "int8":
        return (y / scale).round().clamp(-127, 127) * scale
    return (y / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def least_squares_byte(y: torch.Tensor, amax: torch.Tensor, kind: str) -> torch.Tensor:
    """Among the scale byte's bound and the three bounds below it (the row's largest values
    then clipped to the code's max), the one with the row's least squared error."""
    top = (amax.view(torch.int32).long() + (1 << 20) - 1) >> 20
    best, bound = None, None
    for down in range(4):
        candidate = ((top - down) << 20).int().view(torch.float32)
        err = ((code(y, candidate, kind) - y) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, bound = err, candidate
        else:
            better = err < best
            best, bound = torch.where(better, err, best), torch.where(better, candidate, bound)
    return bound


def least_squares_bound(y: torch.Tensor, amax: torch.Tensor, kind: str) -> torch.Tensor:
    best, bound = None, amax
    for clip in _CLIPS:
        candidate = amax * clip
        err = ((code(y, candidate, kind) - y) ** 2).sum(-1, keepdim=True)
        if best is None:
            best = err
        else:
            better = err < best
            best, bound = torch.where(better, err, best), torch.where(better, candidate, bound)
    return bound


def fake(x: torch.Tensor, scheme: str, part: str, layer: int = 0, feedback=None) -> torch.Tensor:
    """`x` [T, KVH, D] coded and decoded by `scheme` (float32); `layer` names the layer's
    calibrated key offset (`calN`); `feedback` the keys' error-feedback factors (`gN`)."""
    x = x.float()
    kind, bound_kind, *flags = scheme.split("-")
    gflag = [f for f in flags if _feedback_flag(f)]
    if gflag and part == "k":
        # error-feedback rounding against the queries' second moments, in the basis the row is
        # stored in: the scheme's S (if any) and the rotation
        rest = [f for f in flags if f != gflag[0]]
        shaped = [f for f in rest if _shaping_flag(f) and f[0] == "s"]
        s = _shaping(shaped[0], rest, layer) if shaped else None
        factors = _feedback_factors(gflag[0], layer, s, "norot" not in rest)
        return fake(x, "-".join([kind, bound_kind, *rest]), part, layer, factors)
    if gflag:
        flags = [f for f in flags if f != gflag[0]]
    if kind in _FLOATS:
        # the floor: the rows only rounded to a 16-bit float (`bf16-x`, `fp16-x`)
        return x.to(_FLOATS[kind]).float()
    offset = [f for f in flags if f == "kc" or f.startswith("cal")]
    if offset and part == "k":
        # `kc`: the keys' mean over the window's positions (per kv head) kept exact, the rest
        # coded: what a fixed per-(layer, head) key offset could give at best (softmax ignores
        # q . c, the same for every key of a query). `calN`: the offset fixed beforehand, the
        # mean of the keys of the N-th `--calibration` source (another text, random tokens)
        flag = offset[0]
        center = x.mean(0, keepdim=True) if flag == "kc" else _CALIBRATED[flag][layer]
        rest = [f for f in flags if f != flag]
        joined = "-".join([kind, bound_kind, *rest])
        return fake(x - center, joined, part, layer, feedback) + center
    shaped = [f for f in flags if _shaping_flag(f) and (f[0] == "s") == (part == "k")]
    if shaped:
        # channel scaling before the rotation (`k' = H S k`, the query met as `H S^-1 q`, so
        # scores are exact): precision where the queries look. `sN` / `vN`: S from the N-th
        # `--calibration` source, `sw` / `vw` from the window itself (an upper bound); `eP`
        # the exponent, `tie` one factor a RoPE pair
        flag = shaped[0]
        s = _shaping(flag, flags, layer)
        rest = [f for f in flags if f != flag]
        return fake(x * s, "-".join([kind, bound_kind, *rest]), part, layer, feedback) / s
    if kind == "engine":
        dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[bound_kind]
        if feedback is not None:
            return _feedback_rows(x, dtype, feedback)
        return reference.dequantize_rows(reference.quantize_rows(x, dtype))
    rotate = "norot" not in flags
    # `rs`: random signs before the rotation (H D x, D = diag(+-1)): a row whose channels share
    # a sign pattern with one of H's rows no longer concentrates on one channel
    signs = _signs(x.shape[-1]) if "rs" in flags else 1.0
    y = reference.hadamard(x * signs) if rotate else x
    amax = y.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    octaves = _OCTAVES[part]
    for o, n in zip(*torch.unique(torch.floor(torch.log2(amax)).int(), return_counts=True)):
        octaves[o.item()] = octaves.get(o.item(), 0) + n.item()
    bound_kind, _, floor = bound_kind.partition("@")
    bound = {
        "b3": lambda: round_up(amax, 3),
        "b4": lambda: round_up(amax, 4),
        "b5": lambda: round_up(amax, 5),
        "lg16": lambda: log_up(amax, 16),
        "lg20": lambda: log_up(amax, 20),
        "lg24": lambda: log_up(amax, 24),
        "exact": lambda: amax,
        "mse": lambda: least_squares_bound(y, amax, kind),
        "b3mse": lambda: least_squares_byte(y, amax, kind),
    }[bound_kind]()
    if floor:
        # a byte's 256 bounds from 2^floor up: rows below code with the smallest, rows above
        # are clipped to the largest
        steps = {"b4": 16, "b5": 32}.get(bound_kind) or int(bound_kind.removeprefix("lg"))
        low = 2.0 ** float(floor.replace("m", "-"))
        bound = bound.clamp(low, low * 2.0 ** (255 / steps))
    y = code(y, bound, kind)
    return reference.unrotate(y) * signs if rotate else y


def _feedback_flag(flag: str) -> bool:
    return flag[:1] == "g" and flag[1:].removesuffix("o").isdigit()


# per (flag, layer, S's identity): the feedback factors and Sigma's spectrum figures; per
# (flag, layer) the figures of the scheme last coded
_FEEDBACK: dict = {}
_SPECTRUM: dict = {}


def _feedback_factors(flag: str, layer: int, s, rotate: bool) -> tuple:
    """Per kv head the upper Cholesky factor U of `Sigma^-1` ([KVH, D, D], in the channel order
    rounded) and that order ([KVH, D]): what a store would keep per (layer, kv head)."""
    key = (flag, layer, None if s is None else s.sum().item(), rotate)
    if key in _FEEDBACK:
        factors, _SPECTRUM[(flag, layer)] = _FEEDBACK[key]
        return factors
    n = int(flag[1:].removesuffix("o"))
    stats = _STATS[n][layer]
    sigma = stats["qq"].double() / stats["n"]  # [KVH, D, D], post-RoPE queries
    if s is not None:
        inv = 1.0 / s[0].double()  # [KVH, D]: the query meets the scaled key as q / s
        sigma = sigma * inv[:, :, None] * inv[:, None, :]
    d = sigma.shape[-1]
    if rotate:
        # the query meets the rotated row as H q / n: Sigma' = H Sigma H / n^2
        h = reference.hadamard(torch.eye(d, dtype=torch.float32)).double()
        sigma = h @ sigma @ h / float(d & -d) ** 2
    if flag.endswith("o"):
        order = torch.argsort(torch.diagonal(sigma, dim1=-2, dim2=-1), dim=-1, descending=True)
    else:
        order = torch.arange(d).expand(sigma.shape[0], d)
    sigma = torch.stack([m[o][:, o] for m, o in zip(sigma, order)])
    damp = 0.01 * torch.diagonal(sigma, dim1=-2, dim2=-1).mean(-1)
    damped = sigma + damp[:, None, None] * torch.eye(d, dtype=sigma.dtype)
    upper = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    eig = torch.linalg.eigvalsh(sigma)
    trace = eig.sum(-1)
    diag = torch.diagonal(sigma, dim1=-2, dim2=-1)
    top = eig.flip(-1)
    _SPECTRUM[(flag, layer)] = {
        "offdiag_frobenius_share": round(
            ((sigma.square().sum((-2, -1)) - diag.square().sum(-1)) / sigma.square().sum((-2, -1)))
            .sqrt()
            .mean()
            .item(),
            3,
        ),
        "top1_eig_share": round((top[:, 0] / trace).mean().item(), 3),
        "top4_eig_share": round((top[:, :4].sum(-1) / trace).mean().item(), 3),
        "predicted_error_ratio": round(
            ((1.0 / torch.diagonal(upper, dim1=-2, dim2=-1).square()).sum(-1) / trace)
            .mean()
            .item(),
            3,
        ),
    }
    _FEEDBACK[key] = ((upper.float(), order), _SPECTRUM[(flag, layer)])
    return _FEEDBACK[key][0]


def _feedback_rows(x: torch.Tensor, dtype: torch.dtype, factors: tuple) -> torch.Tensor:
    """`reference.quantize_rows` then `dequantize_rows` with the codes chosen by error feedback:
    rows `[T, KVH, D]` rotated, scale byte from their amax as shipped, then channel by channel
    (in `order`) the code nearest the value so far, its error `e` (in the row's scale units)
    pushed onto the later channels as `- e / U_jj * U_j,later` (GPTQ's update): about D^2 / 2
    multiply-adds a row on top of the shipped store."""
    upper, order = factors
    y = reference.hadamard(x)
    byte = reference._bound_byte(y.abs().amax(-1, keepdim=True))
    scale = reference._row_scale(byte, dtype)
    limit = reference._KV_MAX[dtype]
    index = order.unsqueeze(0).expand_as(y)
    w = torch.gather(y / scale, -1, index).clone()
    codes = torch.empty_like(w)
    for j in range(w.shape[-1]):
        value = w[..., j].clamp(-limit, limit)
        coded = value.round() if dtype == torch.int8 else value.to(dtype).float()
        codes[..., j] = coded
        err = (w[..., j] - coded) / upper[:, j, j]
        w[..., j + 1 :] -= err.unsqueeze(-1) * upper[:, j, j + 1 :]
    stored = torch.empty_like(codes).scatter_(-1, index, codes)
    return reference.unrotate(stored * scale)


_FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# per calibration source N, per layer: sums of k, k^2, v^2 and of q^2 over each kv head's group
# of query heads ([1, KVH, D] each) and the count of positions
_STATS: dict = {}
# the window being coded (flags `sw` / `vw`): the same sums over its own positions
_WINDOW: dict = {}
# per layer, `sx`: q / k second moments from the weights alone (inputs taken as isotropic after
# the layer's norm: the squared norms of the q_proj / k_proj rows times the norm's weights)
_WQK: dict = {}
# per layer, the output projection's squared column norms per kv head's group ([1, KVH, D])
_WO: dict = {}


def _stat_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    kvh = k.shape[1]
    q = q.float().reshape(q.shape[0], kvh, -1, q.shape[-1])
    k, v = k.float(), v.float()
    return {
        "k": k.sum(0, keepdim=True),
        "k2": (k * k).sum(0, keepdim=True),
        "v2": (v * v).sum(0, keepdim=True),
        "q2": (q * q).sum((0, 2)).unsqueeze(0),
        "n": k.shape[0],
    }


def _shaping_flag(flag: str) -> bool:
    return flag in ("sw", "vw", "sx") or flag[:1] in ("s", "v") and flag[1:].isdigit()


def _shaping(flag: str, flags: list, layer: int) -> torch.Tensor:
    """S `[1, KVH, D]` minimizing the score error's (keys) or the output's (values) variance
    under an isotropic rotated-domain error: `s_c = (a_c / b_c)^(p / 2)`, `a` the squared size
    of what multiplies the channel (queries; the output projection's columns), `b` the channel's
    mean square; p = 1/2 (`e50`) is the Cauchy-Schwarz optimum. Scaled to keep the rows' energy."""
    stats = {"sw": _WINDOW, "vw": _WINDOW, "sx": _WQK.get(layer)}.get(flag)
    stats = stats or _STATS[int(flag[1:])][layer]
    exponent = next((int(f[1:]) / 100 for f in flags if f[:1] == "e" and f[1:].isdigit()), 0.5)
    if flag[0] == "s":
        a, b = stats["q2"], stats["k2"]
    else:
        a, b = _WO[layer], stats["v2"]
    if "tie2" in flags:
        # one factor a RoPE pair from the pair's summed moments: S then commutes with RoPE and
        # folds into the q / k projections' rows (no kernel change)
        half = a.shape[-1] // 2
        a, b = (torch.cat([x[..., :half] + x[..., half:]] * 2, -1) for x in (a, b))
    s = (a.clamp_min(1e-30) / b.clamp_min(1e-30)) ** (exponent / 2)
    if "tie" in flags:
        half = s.shape[-1] // 2
        pair = (s[..., :half] * s[..., half:]).sqrt()
        s = torch.cat([pair, pair], -1)
    return s * (b.sum(-1, keepdim=True) / (s * s * b).sum(-1, keepdim=True)).sqrt()


def _signs(d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(d)
    return torch.randint(0, 2, (d,), generator=g).float() * 2 - 1


# calibrated key offsets: flag `calN` -> per layer a [1, KVH, D] mean
_CALIBRATED: dict = {}


def with_scheme(holder: dict):
    store = cpu_attention.store_and_attend
    layers: dict = {}

    def patched(q, k, v, k_cache, *args, **kwargs):
        # a layer is known by its cache tensor: the forward passes the layers in order
        layer = layers.setdefault(k_cache.data_ptr(), len(layers))
        scheme = holder.get("scheme")
        record = holder.get("record")
        sums = _stat_sums(q, k, v)
        if record is not None:
            # the queries' second moments per kv head (pooled over its query heads): `gN`
            g = q.float().reshape(q.shape[0], k.shape[1], -1, q.shape[-1])
            sums["qq"] = torch.einsum("tkgd,tkge->kde", g, g)
            old = record.get(layer)
            record[layer] = sums if old is None else {n: old[n] + sums[n] for n in sums}
        if scheme is not None:
            _WINDOW.clear()
            _WINDOW.update(sums)
            plain = scheme.replace("-konly", "").replace("-vonly", "")
            k = k if "-vonly" in scheme else fake(k, plain, "k", layer).to(k.dtype)
            v = v if "-konly" in scheme else fake(v, plain, "v", layer).to(v.dtype)
        return store(q, k, v, k_cache, *args, **kwargs)

    cpu_attention.store_and_attend = patched


def teacher_forced(llm: LLM, windows: list[list[int]]):
    """Per predicted position: the top-1 token, the text token's logprob and the top-1 / top-2
    logprob margin (a near-tie any perturbation may flip)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    top1, logprobs, margins = [], [], []
    for window, out in zip(windows, outs):
        for token, step in zip(window[1:], out.prompt_logprobs[1:]):
            ranked = {lp.rank: (t, lp.logprob) for t, lp in step.items()}
            top1.append(ranked[1][0])
            margins.append(ranked[1][1] - ranked[2][1])
            logprobs.append(step[token].logprob)
    return top1, logprobs, margins


def _output_columns(model: str) -> None:
    """`_WO`: each layer's o_proj squared column norms summed over a kv head's query heads
    (a safetensors model folder)."""
    from safetensors.torch import load_file

    config = json.loads((Path(model) / "config.json").read_text())
    kvh, d = config["num_key_value_heads"], config["head_dim"]
    weights = load_file(str(Path(model) / "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        w = weights[f"model.layers.{layer}.self_attn.o_proj.weight"].float()
        _WO[layer] = (w * w).sum(0).reshape(kvh, -1, d).sum(1).unsqueeze(0)
        norm = weights[f"model.layers.{layer}.input_layernorm.weight"].float()
        wq = weights[f"model.layers.{layer}.self_attn.q_proj.weight"].float() * norm
        wk = weights[f"model.layers.{layer}.self_attn.k_proj.weight"].float() * norm
        _WQK[layer] = {
            "q2": (wq * wq).sum(1).reshape(kvh, -1, d).sum(1).unsqueeze(0),
            "k2": (wk * wk).sum(1).reshape(kvh, d).unsqueeze(0),
        }


def _calibration_windows(llm, source: str, step: int) -> list[list[int]]:
    name, _, tokens = source.rpartition(":") if ":" in source else (source, "", "")
    count = int(tokens) if tokens else 4096
    if name.startswith("random"):
        # `randomS`: another seed S (0 when none)
        vocab = llm.get_tokenizer().vocab_size
        g = torch.Generator().manual_seed(int(name.removeprefix("random") or 0))
        ids = torch.randint(0, vocab, (count + 1,), generator=g).tolist()
    else:
        ids = llm.get_tokenizer().encode(Path(name).read_text())[: count + 1]
    return [ids[i : i + step + 1] for i in range(0, len(ids) - 1, step)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--schemes", nargs="+", required=True)
    p.add_argument(
        "--calibration",
        nargs="*",
        default=[],
        help="key offset sources, flag calN takes the N-th: a text FILE[:TOKENS] or "
        "random[SEED]:TOKENS (token ids from a fixed seed, 0 when none)",
    )
    args = p.parse_args()
    holder: dict = {}
    with_scheme(holder)
    llm = LLM(
        args.model,
        dtype="float32",
        max_model_len=args.window + 64,
        enforce_eager=True,
        enable_prefix_caching=False,
    )
    ids = llm.get_tokenizer().encode(args.text.read_text())[: args.tokens + 1]
    step = args.window
    windows = [ids[i : i + step + 1] for i in range(0, len(ids) - 1, step)]
    for n, source in enumerate(args.calibration):
        holder["record"] = record = {}
        teacher_forced(llm, _calibration_windows(llm, source, step))
        holder.pop("record")
        _STATS[n] = record
        _CALIBRATED[f"cal{n}"] = {layer: r["k"] / r["n"] for layer, r in record.items()}
    ref_top1, ref_logprobs, ref_margins = teacher_forced(llm, windows)
    shaped = [f for x in args.schemes for f in x.split("-")[2:] if _shaping_flag(f)]
    if any(f[0] == "v" or f == "sx" for f in shaped):
        _output_columns(args.model)
    ref_ppl = math.exp(-sum(ref_logprobs) / len(ref_logprobs))
    ties = {t: sum(m < t for m in ref_margins) for t in _TIES}
    print(
        json.dumps(
            {
                "scheme": "float",
                "positions": len(ref_top1),
                "perplexity": ref_ppl,
                "float_margin_below": ties,
            }
        )
    )
    for scheme in args.schemes:
        holder["scheme"] = scheme
        top1, logprobs, _ = teacher_forced(llm, windows)
        flips = [m for a, b, m in zip(top1, ref_top1, ref_margins) if a != b]
        differ = len(flips)
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        result = {
            "scheme": scheme,
            "top1_agreement": round(1 - differ / len(top1), 5),
            "differ": differ,
            # of the flips, how many were float near-ties (top-1 / top-2 margin below t nats),
            # and the agreement over the positions that were not
            "flips_margin_below": {t: sum(m < t for m in flips) for t in _TIES},
            "agreement_without_ties": {
                t: round(1 - sum(m >= t for m in flips) / (len(top1) - ties[t]), 5) for t in _TIES
            },
            "perplexity_vs_float": round(ppl / ref_ppl - 1, 5),
            # a steadier figure than the count of flipped near-ties: how far each position's
            # logprob of the text's token moved
            "mean_abs_dlogprob": round(
                sum(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) / len(logprobs), 6
            ),
            "rows_per_octave_of_amax": {
                part: dict(sorted(counts.items())) for part, counts in _OCTAVES.items()
            },
        }
        gflags = [f for f in scheme.split("-")[2:] if _feedback_flag(f)]
        if gflags:
            result["sigma_spectrum_per_layer"] = {
                layer: fig for (flag, layer), fig in sorted(_SPECTRUM.items()) if flag == gflags[0]
            }
        _OCTAVES.update(k={}, v={})
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
