"""Q4_K, Q6_K and Q8_0 word kernels (kernels/triton/wmatvec.py) vs `dequantize(...) @ x` in float64, on fresh
random blocks.

Also the permuted activations they read: permute_k4 / unpermute_k4, rms_norm's permuted copy and the byte
kernel's gate/up writing h permuted. CUDA when available, else Triton's interpreter (set before import).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from support.kernel_checks import check_bound, matvec_case, quant_weights, router_logits, vec  # noqa: E402

from moerun.kernels.reference import ACTIVATIONS  # noqa: E402
from moerun.kernels.torch_ops import permute_k4, unpermute_k4  # noqa: E402
from moerun.kernels.triton import decode_ops as dk  # noqa: E402
from moerun.kernels.triton import qmatvec as qk  # noqa: E402
from moerun.kernels.triton import wmatvec as wk  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
Q4_K, Q6_K, Q8_0 = int(T.Q4_K), int(T.Q6_K), int(T.Q8_0)
WORDS = [T.Q4_K, T.Q6_K, T.Q8_0]
TILES = [None, wk.WTile(1, 1), wk.WTile(4, 2, 1, 1), wk.WTile(8, 1, 2, 2)]  # default, and odd combinations


def test_permutation() -> None:
    x = torch.arange(512.0)
    xp = permute_k4(x)
    assert xp[64 * 3 + 5] == 4 * 5 + 3 and xp[256 + 64] == 257  # slot 64 k + a holds element 4 a + k
    assert torch.equal(unpermute_k4(xp), x)
    assert torch.equal(permute_k4(x[None].expand(3, 512)), xp[None].expand(3, 512))


def test_supports() -> None:
    assert wk.supports(Q4_K, 2048) and not wk.supports(Q4_K, 2048 + 32) and not wk.supports(int(T.Q5_K), 2048)
    assert wk.supports(Q8_0, 2048, "down") and not wk.supports(Q8_0, 2048 + 32, "mv")
    assert wk.supports(Q6_K, 2048, "down") and wk.supports(Q6_K, 2048, "gate_up") and ("mv", Q6_K) in wk.PAD
    assert wk.wtile_for("down", 37, 512, 37, torch.device("cpu"), qtype=Q6_K) == wk.WTile(1, 2)  # TYPE_WTILES
    assert wk.supports(Q6_K, 2048, "mv", 50304) and wk.supports(Q6_K, 2048, "mv", 2048)  # no MIN_ROWS on bytes
    assert wk.wtile_for("down", 37, 512, 37, torch.device("cpu"), qtype=wk.Q6B) == wk.WTile(1, 2)
    assert wk.WORD_TYPES == {Q4_K, Q6_K, Q8_0}


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("m,n_sb,res", [(1, 1, False), (37, 3, True), (130, 2, False)])
@pytest.mark.parametrize("qtype", WORDS, ids=lambda t: t.name)
def test_qmatvec_w(qtype, m, n_sb, res, tile, device, rng) -> None:
    """Q6_K with an odd block count (n_sb 1, 3) puts odd rows at 2-byte offsets; an even one keeps all aligned."""
    gen, seed = rng
    k = 256 * n_sb
    raw, dense = quant_weights(int(qtype), (m,), k, gen, device)
    x = vec(gen, k)
    out, residual, ref, bound = matvec_case(dense, x, res, gen, device)  # out aliases residual if res
    got = wk.KERNELS["mv"][int(qtype)](raw, permute_k4(x).to(device), out, residual, tile=tile)
    assert got is out
    check_bound(out, ref, bound, seed, f"{qtype.name} matvec M={m} K={k} tile={tile}")


@pytest.mark.parametrize(
    "perm_out,tile", [(False, t) for t in TILES] + [(True, None), (True, wk.WTile(8, 1))], ids=str
)
@pytest.mark.parametrize("qtype", WORDS, ids=lambda t: t.name)
def test_moe_gate_up_w(qtype, perm_out, tile, device, rng) -> None:
    gen, seed = rng
    e, f, k = (5, 256, 256) if perm_out else (5, 37, 768)  # perm_out: whole blocks of rows (few, interpreted)
    wg, dg = quant_weights(int(qtype), (e, f), k, gen, device)
    wu, du = quant_weights(int(qtype), (e, f), k, gen, device)
    x = vec(gen, k)
    xd = x.double()
    cases = [([4, 1, 4], "silu", torch.int64), ([2], "gelu_tanh", torch.int32)]
    for ids_list, act, dtype in cases[1:] if perm_out else cases:
        ids = torch.tensor(ids_list, dtype=dtype)
        g, u = dg[ids] @ xd, du[ids] @ xd  # [n_sel, F]
        a = ACTIVATIONS[act](g)
        ref = a * u
        bound = 1.2 * (dg[ids].abs() @ xd.abs()) * u.abs() + a.abs() * (du[ids].abs() @ xd.abs())
        out = torch.full((len(ids_list), f), float("nan"), device=device)
        wk.KERNELS["gate_up"][int(qtype)](wg, wu, permute_k4(x).to(device), ids.to(device), out, act,
                                          perm_out=perm_out, tile=tile)
        got = unpermute_k4(out.cpu()) if perm_out else out
        check_bound(got, ref, bound, seed, f"{qtype.name} gate_up ids={ids_list} {act} perm_out={perm_out} tile={tile}")


@pytest.mark.parametrize("e,n_sel,renorm,ties", [(6, 3, False, True), (64, 8, True, False), (37, 2, True, True)])
@pytest.mark.parametrize("qtype", WORDS, ids=lambda t: t.name)
def test_moe_gate_up_w_routes(qtype, e, n_sel, renorm, ties, device, rng) -> None:
    """With `route` the launch chooses the experts itself: ids, weights and h equal route_topk's choice followed
    by the plain launch, bit for bit (ties among the logits go to the lower index in both)."""
    gen, seed = rng
    f, k = 37, 256
    wg, _ = quant_weights(int(qtype), (e, f), k, gen, device)
    wu, _ = quant_weights(int(qtype), (e, f), k, gen, device)
    xp = permute_k4(vec(gen, k)).to(device)
    logits = router_logits(gen, e, n_sel, ties).to(device)
    want_w, want_ids = torch.full((n_sel,), float("nan"), device=device), torch.full((n_sel,), -1, device=device,
                                                                                       dtype=torch.int32)
    dk.route_topk(logits, n_sel, renorm, want_w, want_ids)
    want = wk.KERNELS["gate_up"][int(qtype)](wg, wu, xp, want_ids, torch.empty(n_sel, f, device=device))
    got_w, got_ids = torch.full_like(want_w, float("nan")), torch.full_like(want_ids, -1)
    got = wk.KERNELS["gate_up"][int(qtype)](wg, wu, xp, got_ids, torch.full((n_sel, f), float("nan"), device=device),
                                            route=wk.Route(logits, got_w, renorm))
    msg = f"seed={seed} {qtype.name} E={e} n_sel={n_sel} logits={logits.tolist()}"
    assert torch.equal(got_ids, want_ids), msg
    torch.testing.assert_close(got_w, want_w, rtol=2e-7, atol=0, msg=msg)
    assert torch.equal(got, want), msg


def test_moe_gate_up_w_routes_at_most_max_e(device) -> None:
    w = torch.zeros(2, 256, 144, dtype=torch.uint8, device=device)
    e = dk.ROUTE_MAX_E + 1
    route = wk.Route(torch.zeros(e, device=device), torch.zeros(2, device=device), False)
    with pytest.raises(ValueError, match=f"at most {dk.ROUTE_MAX_E} experts"):
        wk.moe_gate_up_w(w, w, torch.zeros(256, device=device), torch.zeros(2, dtype=torch.int32, device=device),
                         torch.zeros(2, 256, device=device), route=route)


@pytest.mark.parametrize("qtype,size", [(T.Q4_K, 144), (T.Q8_0, 272)], ids=str)
def test_moe_gate_up_w_perm_out_needs_whole_blocks(qtype, size, device) -> None:
    w = torch.zeros(2, 37, size, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="F % 256"):
        wk.KERNELS["gate_up"][int(qtype)](w, w, torch.zeros(256, device=device),
                                          torch.zeros(1, dtype=torch.int32, device=device),
                                          torch.zeros(1, 37, device=device), perm_out=True)


@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("qtype,f,padded", [(T.Q4_K, 768, False), (T.Q6_K, 768, False), (T.Q6_K, 512, False),
                                            (T.Q6_K, 768, True), (T.Q8_0, 768, False)], ids=str)
def test_moe_down_w(qtype, f, padded, tile, device, rng) -> None:
    """Q6_K on the file's rows (odd blocks at 2-byte offsets) and on `pad_q6k`'s word-aligned copy."""
    gen, seed = rng
    e, n = 5, 37
    w, dw = quant_weights(int(qtype), (e, n), f, gen, device)
    if padded:
        w = wk.pad_q6k(w)
    for ids_list, dtype in [([3, 0, 3], torch.int32), ([1], torch.int64)]:
        n_sel = len(ids_list)
        ids = torch.tensor(ids_list, dtype=dtype)
        h = vec(gen, n_sel, f)
        wts = torch.from_numpy(gen.uniform(0.05, 1.0, n_sel).astype(np.float32))
        r = vec(gen, n)
        parts = torch.einsum("snf,sf->sn", dw[ids], h.double())
        bounds = torch.einsum("snf,sf->sn", dw[ids].abs(), h.double().abs())
        ref = r.double() + (wts.double()[:, None] * parts).sum(0)
        bound = r.double().abs() + (wts.double()[:, None] * bounds).sum(0)
        out = r.to(device)  # out aliases residual
        wk.KERNELS["down"][int(qtype)](w, permute_k4(h).to(device), ids.to(device), wts.to(device), out, out, tile=tile)
        check_bound(out, ref, bound, seed, f"{qtype.name} down ids={ids_list} F={f} padded={padded} tile={tile}")


@pytest.mark.parametrize("qtype", WORDS, ids=lambda t: t.name)
def test_deterministic(qtype, device, rng) -> None:
    gen, _ = rng
    raw, _ = quant_weights(int(qtype), (130,), 512, gen, device)
    xp = permute_k4(vec(gen, 512)).to(device)
    mv = wk.KERNELS["mv"][int(qtype)]
    assert torch.equal(mv(raw, xp, torch.empty(130, device=device)), mv(raw, xp, torch.empty(130, device=device)))


@pytest.mark.parametrize("qtype,size,sizes", [(T.Q6_K, 210, "210, 212, 288"), (T.Q8_0, 272, "272")], ids=str)
def test_rows_checked(qtype, size, sizes, device) -> None:
    w = torch.zeros(4, size + 1, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=f"{qtype.name} rows must be contiguous {sizes}-byte rows"):
        wk.KERNELS["mv"][int(qtype)](w, torch.zeros(256, device=device), torch.zeros(4, device=device))


@pytest.mark.parametrize("kind", ["mv", "gate_up", "down"])
def test_padded_q6k_same_bits(kind, device, rng) -> None:
    """`pad_q6k` keeps every block's bytes and appends two zeros; each word kernel gives the same bits on the
    padded copy as on the file's rows (odd block counts: every other block at a 2-byte offset there)."""
    gen, _ = rng
    k = 768
    raw, _ = quant_weights(Q6_K, (3, 37), k, gen, device)
    padded = wk.pad_q6k(raw)
    assert padded.shape == (3, 37, 3 * 212)
    blocks = padded.reshape(3, 37, 3, 212)
    assert torch.equal(blocks[..., :210].reshape(raw.shape), raw) and not blocks[..., 210:].any()
    fn = wk.KERNELS[kind][Q6_K]
    ids = torch.tensor([2, 0], dtype=torch.int32, device=device)
    outs = []
    for w in (raw, padded):
        if kind == "mv":
            out = fn(w[0], permute_k4(torch.linspace(-1, 1, k)).to(device), torch.empty(37, device=device))
        elif kind == "gate_up":
            out = fn(w, w, permute_k4(torch.linspace(-1, 1, k)).to(device), ids, torch.empty(2, 37, device=device))
        else:
            h = permute_k4(torch.linspace(-1, 1, 2 * k).reshape(2, k)).to(device)
            out = fn(w, h, ids, torch.tensor([0.25, 0.75], device=device), torch.ones(37, device=device),
                     torch.empty(37, device=device))
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="whole 210-byte blocks"):
        wk.pad_q6k(torch.zeros(2, 211, dtype=torch.uint8))


@pytest.mark.parametrize("tile", [None, wk.WTile(1, 1), wk.WTile(4, 2, 1, 1), wk.WTile(2, 4, 2, 2)], ids=str)
@pytest.mark.parametrize("kind", ["mv", "gate_up", "down"])
def test_bytes_q6k(kind, tile, device, rng) -> None:
    """`bytes_q6k`'s copy holds the same values (its own dequantization equals gguf's of the file's rows, bit for
    bit), and each word kernel reads it (row size 288 per block) within the bound of the exact product; 3 blocks,
    37 rows, fresh inputs, NaN-poisoned outputs."""
    gen, seed = rng
    k, m = 768, 37
    raw, dense = quant_weights(Q6_K, (3, m), k, gen, "cpu")
    b = wk.bytes_q6k(raw)
    assert b.shape == (3, m, 3 * 288) and not b.reshape(3, m, 3, 288)[..., 274:].any()
    blk = b.reshape(3, m, 3, 288)
    sc = blk[..., 256:272].contiguous().view(torch.int8).double().repeat_interleave(16, -1)
    d = blk[..., 272:274].contiguous().view(torch.float16).double()
    assert torch.equal((d * sc * (blk[..., :256].double() - 32)).reshape(3, m, k), dense.double())
    with pytest.raises(ValueError, match="whole 210-byte blocks"):
        wk.bytes_q6k(torch.zeros(2, 211, dtype=torch.uint8))
    b, dd = b.to(device), dense.double()
    fn = wk.KERNELS[kind][Q6_K]
    ids = torch.tensor([2, 0], dtype=torch.int32)
    x = vec(gen, 2, k)
    if kind == "mv":
        r = vec(gen, m)
        out = r.clone().to(device)
        fn(b[1], permute_k4(x[0]).to(device), out, out, tile=tile)
        ref, bound = r.double() + dd[1] @ x[0].double(), r.double().abs() + dd[1].abs() @ x[0].double().abs()
    elif kind == "gate_up":
        out = torch.full((2, m), float("nan"), device=device)
        fn(b, b, permute_k4(x[0]).to(device), ids.to(device), out, tile=tile)
        g = dd[ids] @ x[0].double()
        ref = ACTIVATIONS["silu"](g) * g
        bound = 2.2 * (dd[ids].abs() @ x[0].double().abs()) * g.abs()
    else:
        wts, r = torch.tensor([0.25, 0.75]), vec(gen, m)
        out = torch.full((m,), float("nan"), device=device)
        fn(b, permute_k4(x).to(device), ids.to(device), wts.to(device), r.to(device), out, tile=tile)
        parts = torch.einsum("snf,sf->sn", dd[ids], x.double())
        ref = r.double() + (wts.double()[:, None] * parts).sum(0)
        bound = r.double().abs() + (wts.double()[:, None] * torch.einsum("snf,sf->sn", dd[ids].abs(),
                                                                        x.double().abs())).sum(0)
    check_bound(out, ref, bound, seed, f"Q6_K bytes {kind} tile={tile}")


def test_rms_norm_perm(device, rng) -> None:
    gen, _ = rng
    x, w = vec(gen, 2, 512).to(device), vec(gen, 512).to(device)
    out = torch.full((2, 512), float("nan"), device=device)
    xp = torch.full((2, 512), float("nan"), device=device)
    dk.rms_norm(x, w, 1e-6, out, xp)
    assert torch.equal(xp.cpu(), permute_k4(out.cpu()))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_byte_gate_up_perm_out(qtype, device, rng) -> None:
    """qmatvec's gate/up writes h permuted for a word-kernel down product of another type's gate/up."""
    gen, _ = rng
    wg, _ = quant_weights(int(qtype), (3, 256), 256, gen, device)
    wu, _ = quant_weights(int(qtype), (3, 256), 256, gen, device)
    x, ids = vec(gen, 256).to(device), torch.tensor([2, 0], dtype=torch.int32, device=device)
    plain = qk.moe_gate_up(wg, wu, int(qtype), int(qtype), x, ids, torch.empty(2, 256, device=device))
    perm = qk.moe_gate_up(wg, wu, int(qtype), int(qtype), x, ids, torch.empty(2, 256, device=device), perm_out=True)
    assert torch.equal(perm.cpu(), permute_k4(plain.cpu()))

