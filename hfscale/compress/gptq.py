"""GPTQ (Frantar et al. 2022, arXiv 2210.17323, Algorithm 1) onto torchao's int4 weight-only grid.

Why: round-to-nearest (RTN, what `quantize_(IntxWeightOnlyConfig)` does) rounds every weight on its
own. GPTQ rounds the columns of a weight one at a time and pushes each column's rounding error onto
the columns not yet rounded, weighted by how the layer's inputs correlate, so the layer's *output*
error on calibration data is what gets minimised, not the weight error. Same bits, same file format,
lower perplexity.

What is minimised, per nn.Linear with weight W [out, in] and calibration inputs x_1..x_N [in]:

    H = (2/N) * sum_t x_t x_t^T                       (the layer Hessian, [in, in])
    proxy_loss(W^) = trace((W - W^) H (W - W^)^T)     (= (2/N) * sum_t ||W x_t - W^ x_t||^2)

Algorithm (one Linear; columns j = 0..in-1 in their natural order, "lazy batches" of 128 columns):

    dead inputs (H_jj == 0): H_jj = 1 and W[:, j] = 0  (the column never sees a signal)
    H += damp * mean(diag H) * I                        (damping, keeps the inverse well-conditioned)
    U = cholesky(H^-1, upper)                           (H^-1 = U^T U)
    for j:  q_j   = quant(W[:, j])                      (torchao's grid, fixed scales, see below)
            err_j = (W[:, j] - dequant(q_j)) / U_jj
            W[:, k] -= err_j * U_jk     for every k > j (error feedback onto the unrounded columns)

Scales and zero points ("static groups"): computed once on the ORIGINAL weight with torchao's own
`choose_qparams_affine`, exactly as `IntxUnpackedToInt8Tensor.from_hp` does for the AFFINE algorithm
(int4 bounds [-8, 7], int8 zero points, group of `group_size` input columns, or one per output row
for group_size 0), and never changed by the error feedback. quant/dequant are torchao's formulas:

    q  = clamp(round(w * (1 / scale)) + zero_point, -8, 7)      W^ = (q - zero_point) * scale

so W^ lies exactly on the grid and `from_hp(W^, custom_scale=scale, custom_zero_point=zp)` gives back
the GPTQ integers (checked per layer). The weight becomes the same `IntxUnpackedToInt8Tensor` that
`IntxWeightOnlyConfig` produces, so the model saves and reloads like any TorchAoConfig model once
`save.attach_torchao_quantizer` has been applied (`ptq.quantize_model` does this).

Precision: H is accumulated in float32 (sum of per-batch x^T x, scaled by 2/N at the end); the
Cholesky factorisation runs in float64; the column loop runs in float32; proxy losses in float64.

Limitation: every selected Linear's Hessian is held at once, sum over linears of in^2 * 4 bytes
(down_proj's intermediate^2 dominates): Gemma 3 270M 0.5 GB, 1B 5.8 GB, 4B 19 GB, 12B 63 GB,
27B 155 GB. And all Hessians come from ONE forward pass of the float model, so a layer's inputs are
the float model's, not those of the already-quantized layers before it (the paper's reference runs
block by block on quantized inputs). Fine up to ~1-4B parameters; 27B needs a layer-by-layer pass
(capture one decoder block's inputs, quantize it, feed its quantized outputs to the next), which
holds one block's Hessians (2.5 GB at 27B). No act-order: columns are rounded in natural order.
"""

from __future__ import annotations

from ..util.errors import HfscaleError
from .schemes import QuantSpec

BLOCK = 128  # columns per lazy batch (Algorithm 1's B)


def gptq_quantize_(model, spec: QuantSpec, calibration, progress: bool = True, damp: float = 0.01, batch_size: int = 4) -> dict:
    """Replace the weight of every Linear picked by `linear_filter(spec.include_embeddings)` with GPTQ int4.

    `calibration`: int64 token blocks [n, seq] (train split, never the scored one). Returns stats:
    per-layer and total proxy losses for RTN and GPTQ (same scales), n_layers, calibration_tokens.
    """
    from tqdm.auto import tqdm

    from .schemes import _mapping, linear_filter

    calibration = _check_calibration(calibration)
    if batch_size < 1 or not damp > 0:
        raise HfscaleError(f"GPTQ needs batch_size >= 1 and damp > 0 (got {batch_size}, {damp})")
    keep = linear_filter(spec.include_embeddings)
    linears = {name: m for name, m in model.named_modules() if keep(m, name)}
    if not linears:
        raise HfscaleError("the model has no nn.Linear to quantize; GPTQ applies to transformer decoders")
    for name, m in linears.items():
        if spec.group_size and m.in_features % spec.group_size:
            raise HfscaleError(f"{name} has {m.in_features} inputs, not a multiple of --group-size {spec.group_size}; "
                               "use a group size that divides it or 0 (per-channel)")
    hessians, n_tokens = collect_hessians(model, linears, calibration, batch_size)
    layers = {}
    for name in tqdm(list(linears), desc="GPTQ", unit="layer", disable=not progress):
        layers[name] = gptq_linear_(linears[name], hessians.pop(name), spec.group_size, _mapping(spec), damp)
    return {
        "layers": layers,
        "proxy_loss_rtn": sum(s["proxy_loss_rtn"] for s in layers.values()),
        "proxy_loss_gptq": sum(s["proxy_loss_gptq"] for s in layers.values()),
        "n_layers": len(layers),
        "calibration_tokens": n_tokens,
    }


def _check_calibration(calibration):
    import torch

    if calibration is not None:
        calibration = torch.as_tensor(calibration)
    if calibration is None or calibration.numel() == 0:
        raise HfscaleError("gptq-int4wo needs calibration token blocks; pass --calibration builtin or a text file")
    if calibration.dim() != 2 or calibration.dtype not in (torch.int64, torch.int32):
        raise HfscaleError(f"calibration must be integer token blocks [n, seq] (got {tuple(calibration.shape)} "
                           f"{calibration.dtype}); build them with hfscale.compress.evaluate.calibration_blocks")
    return calibration.long()


def collect_hessians(model, linears: dict, calibration, batch_size: int):
    """One no-grad pass over `calibration`: H = (2/N) sum x x^T for each Linear's input. Returns (H by name, N)."""
    import torch

    hessians = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float32, device=m.weight.device)
                for n, m in linears.items()}
    counts = dict.fromkeys(linears, 0)

    def hook_for(name):
        def hook(module, args, kwargs, output):
            x = (args[0] if args else kwargs["input"]).detach().reshape(-1, module.in_features).float()  # [tokens, in]
            hessians[name].addmm_(x.T, x)                                  # H += x^T x
            counts[name] += x.shape[0]
        return hook

    handles = [m.register_forward_hook(hook_for(n), with_kwargs=True) for n, m in linears.items()]
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(calibration), batch_size):
                model(input_ids=calibration[i : i + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    for name, H in hessians.items():
        if counts[name] == 0:
            raise HfscaleError(f"{name} saw no calibration tokens (not on the forward path?); it cannot be GPTQ-quantized")
        H.mul_(2.0 / counts[name])  # sum -> (2/N) sum
    return hessians, max(counts.values())


def int4_bounds() -> tuple[int, int]:
    """torchao's int4 code range, (-8, 7)."""
    import torch
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    return _DTYPE_TO_QVALUE_BOUNDS[torch.int4]


def int4_qparams(weight, block_size, mapping_type):
    """(scale, zero_point) of `weight` exactly as IntxUnpackedToInt8Tensor.from_hp computes them (AFFINE)."""
    import torch
    from torchao.quantization.quant_primitives import choose_qparams_affine

    qmin, qmax = int4_bounds()
    return choose_qparams_affine(weight, mapping_type, block_size, target_dtype=torch.int8, quant_min=qmin,
                                 quant_max=qmax, zero_point_dtype=torch.int8, keepdim=True)


def _inverse_hessian_factor(H, damp: float):
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, in float64; damping x10 on failure."""
    import torch

    H = H.double()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    mean_diag = H.diagonal().mean()
    for _ in range(4):
        try:
            L = torch.linalg.cholesky(H + damp * mean_diag * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
        except torch.linalg.LinAlgError:
            damp *= 10
    raise HfscaleError(f"the calibration Hessian is not positive definite even with damp={damp:g}; "
                       "use more (or more varied) calibration blocks")


def gptq_weight(weight, H, scale, zero_point, group_size: int, damp: float = 0.01):
    """GPTQ of `weight` [out, in] on the fixed int4 grid (scale, zero_point [out, in/group]).

    Returns (q int8 [out, in], W^ float32 [out, in]) with W^ = (q - zero_point) * scale. `H` is not modified.
    """
    import torch

    W = weight.detach().float().clone()
    H = H.float().clone()
    cols = W.shape[1]
    group = group_size or cols
    s = scale.float().repeat_interleave(group, dim=1)       # [out, in]: each column's scale
    z = zero_point.float().repeat_interleave(group, dim=1)
    inv_s = 1.0 / s                                          # torchao rounds w * (1 / scale)
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0                                      # dead input: keep H invertible ...
    W[:, dead] = 0.0                                         # ... and drop its weights (no signal)
    U = _inverse_hessian_factor(H, damp).float()
    Q = torch.empty_like(W, dtype=torch.int8)
    W_hat = torch.empty_like(W)
    for i0 in range(0, cols, BLOCK):
        i1 = min(i0 + BLOCK, cols)
        err = _gptq_block(W, U, (s, z, inv_s), Q, W_hat, i0, i1)
        W[:, i1:] -= err @ U[i0:i1, i1:]                     # lazy batch: propagate the block's error at once
    return Q, W_hat


def _gptq_block(W, U, grid, Q, W_hat, i0: int, i1: int):
    """Columns i0..i1-1 of Algorithm 1; writes Q, W^; returns the scaled errors [out, i1-i0]."""
    import torch

    s, z, inv_s = grid
    qmin, qmax = int4_bounds()
    Wb = W[:, i0:i1].clone()
    E = torch.empty_like(Wb)
    for j in range(i1 - i0):
        c = i0 + j
        q = torch.clamp(torch.round(Wb[:, j] * inv_s[:, c]) + z[:, c], qmin, qmax)
        W_hat[:, c] = (q - z[:, c]) * s[:, c]
        Q[:, c] = q.to(torch.int8)
        E[:, j] = (Wb[:, j] - W_hat[:, c]) / U[c, c]                     # err_j = (w - w^) / U_jj
        Wb[:, j + 1 :] -= E[:, j : j + 1] * U[c, c + 1 : i1].unsqueeze(0)  # feed it to the block's later columns
    return E


def proxy_loss(weight, w_hat, H) -> float:
    """trace((W - W^) H (W - W^)^T), the quantity GPTQ minimises, in float64."""
    D = (weight.double() - w_hat.double())
    return float(((D @ H.double()) * D).sum())


def gptq_linear_(linear, H, group_size: int, mapping_type, damp: float = 0.01) -> dict:
    """GPTQ one nn.Linear in place with its Hessian H; its weight becomes an IntxUnpackedToInt8Tensor."""
    import torch
    from torchao.quantization.quant_primitives import dequantize_affine, quantize_affine
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    w = linear.weight.detach()
    qmin, qmax = int4_bounds()
    block_size = (1, group_size or w.shape[1])
    scale, zp = int4_qparams(w, block_size, mapping_type)
    q, _ = gptq_weight(w, H, scale, zp, group_size, damp)
    # W^ exactly as torchao dequantizes it (in the weight's dtype), so from_hp re-derives the same q
    w_hat = dequantize_affine(q, block_size, scale, zp, torch.int8, qmin, qmax, output_dtype=w.dtype)
    q_rtn = quantize_affine(w, block_size, scale, zp, torch.int8, qmin, qmax)
    w_rtn = dequantize_affine(q_rtn, block_size, scale, zp, torch.int8, qmin, qmax, output_dtype=w.dtype)
    new = IntxUnpackedToInt8Tensor.from_hp(w_hat, block_size, torch.int4, mapping_type=mapping_type,
                                           intx_choose_qparams_algorithm=None, custom_scale=scale, custom_zero_point=zp)
    if not torch.equal(new.qdata, q):
        raise RuntimeError("GPTQ output is off torchao's int4 grid (from_hp re-quantized it differently); please report")
    stats = {"proxy_loss_rtn": proxy_loss(w, w_rtn, H), "proxy_loss_gptq": proxy_loss(w, w_hat, H)}
    linear.weight = torch.nn.Parameter(new, requires_grad=False)
    return stats
