"""Programmatic dependent launch (moerun/kernels/triton/pdl.py, on in the decode step on sm_90+): when it is on, and
that a PDL kernel waits for the kernel before it ahead of its first access to anything the step writes (compiled
for sm_90 without a GPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from moerun.kernels.triton import pdl  # noqa: E402


def test_launch_args() -> None:
    """Off by default and outside `launches`; never on the CPU; `launches` restores the state it found."""
    cpu = torch.device("cpu")
    assert pdl.launch_args(cpu) == {"PDL": False}
    with pdl.launches(True):
        assert pdl.launch_args(cpu) == {"PDL": False}  # the interpreter has no griddepcontrol
        with pdl.launches(False):
            assert not pdl._on[0]
        assert pdl._on[0]
        if torch.cuda.is_available():
            want = torch.cuda.get_device_capability() >= pdl.MIN_CAPABILITY
            assert pdl.launch_args(torch.device("cuda")).get("launch_pdl", False) == want
    assert not pdl._on[0]


_COMPILE = """
import inspect
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moerun.kernels.triton import attention as ak, decode_ops as dk, embed as ek, imatvec as ik, qmatvec as qk
pdl = sys.argv[1] == "1"
if sys.argv[2] == "rms_norm":  # the weight loaded before the wait
    fn, consts = dk._rms_norm_kernel, {"BLOCK": 2048, "PERM": False, "X24": False, "PDL": pdl}
    types = {"eps": "fp32", "N": "i32"}
elif sys.argv[2] == "argmax":  # the logits: nothing before the wait
    fn, consts = dk._argmax_chunk_kernel, {"CHUNK": 2048, "PDL": pdl}
    types = {"idx_ptr": "*i32", "V": "i32"}
elif sys.argv[2] == "gate_up_late":  # the routed Q4_K gate/up before a routed down: its trigger after its wait
    fn = ik._igate_up_kernel
    consts = dict(QT=12, U=36, N_BLOCKS=8, R=4, NB=8, T=8, ACT=0, PERM_OUT=False, ROUTE=True, N_SEL=8, RENORM=False,
                  BLOCK_E=64, BLOCK_K=8, H24=True, EMU=False, PDL=pdl, LATE=True)
    types = {p: "*i32" for p in ("wg_ptr", "wu_ptr", "xl_ptr", "ids_ptr", "cnt_ptr")}
    types |= {"wg16_ptr": "*i16", "wu16_ptr": "*i16", "wg8_ptr": "*i8", "wu8_ptr": "*i8", "xh_ptr": "*i64",
              "hh_ptr": "*i16", "hl_ptr": "*u8", "E": "i32", "F": "i32", "stride_ge": "i32", "stride_ue": "i32",
              "stride_out": "i32"}
elif sys.argv[2] == "down_route":  # the Q4_K down ranking its experts from the logits, 2 ahead
    fn = ik._idown_kernel
    consts = dict(QT=12, U=36, N_BLOCKS=4, N_SEL=8, R=2, NB=4, T=8, EU=2, EMU=False, ROUTE=True, BLOCK_E=64,
                  BLOCK_K=8, PDL=pdl)
    types = {"w_ptr": "*i32", "w16_ptr": "*i16", "w8_ptr": "*i8", "hh_ptr": "*i64", "hl_ptr": "*i32",
             "ids_ptr": "*i32", "N": "i32", "stride_e": "i32", "E": "i32"}
elif sys.argv[2] == "byte_gate_up_late":  # the routed F16 gate/up before a routed byte down
    fn = qk._moe_gate_up_kernel
    consts = dict(NBLK_G=2048, NBLK_U=2048, QG=1, QU=1, ACT=0, BM=2, NBG=1024, NBU=1024, PERM_OUT=False, ROUTE=True,
                  N_SEL=8, RENORM=False, BLOCK_E=64, BLOCK_K=8, PDL=pdl, LATE=True)
    types = {"wg_ptr": "*fp16", "wu_ptr": "*fp16", "ids_ptr": "*i32"}
    types |= {p: "i32" for p in ("E", "F", "stride_ge", "stride_gm", "stride_ue", "stride_um", "stride_out")}
elif sys.argv[2] == "byte_down_route":  # the F16 down ranking its experts from the logits, 2 ahead
    fn = qk._moe_down_kernel
    consts = dict(N_BLOCKS=1024, N_SEL=8, QTYPE=1, BM=2, NB=1024, EU=2, ROUTE=True, BLOCK_E=64, BLOCK_K=8, PDL=pdl)
    types = {"w_ptr": "*fp16", "ids_ptr": "*i32"}
    types |= {p: "i32" for p in ("N", "stride_e", "stride_m", "stride_h", "E")}
elif sys.argv[2] == "embed":  # the step's first kernel: its wait before its trigger
    fn, consts = ek._embed_kernel, {"QTYPE": 1, "BKC": 256, "PDL": pdl}
    types = {"w_ptr": "*fp16", "ids_ptr": "*i64", "scale": "fp32", "K": "i32", "stride_w": "i32", "stride_out": "i32"}
elif sys.argv[2].startswith("attn_"):  # OLMoE's split attention with RoPE + full QK-norm: attn_short / attn_long or
    # a variant's (block_n, early, ahead, dot): attn_32_1_1_1
    fn = ak._attn_split_kernel
    name = sys.argv[2].removeprefix("attn_")
    bn, early, ahead, dot = {"short": (64, 1, 0, 0), "long": (64, 0, 0, 0)}.get(name) or map(int, name.split("_"))
    consts = dict(G=1, D=128, DV=128, N_SPLITS=25, BLOCK_N=bn, BLOCK_D=128, BLOCK_DV=128, ROPE=True, H=16, R=128,
                  QK_NORM=2, NEOX=1, K_BF16=False, V_BF16=False, BLOCK_FQ=2048, BLOCK_FK=2048, FUSED=True,
                  BLOCK_S=32, PERM=False, X24=False, MIN_SPLIT=128, EARLY=bool(early), AHEAD=bool(ahead),
                  DOT=bool(dot), PDL=pdl)
    types = {"k_ptr": "*fp16", "v_ptr": "*fp16", "len_ptr": "*i64", "cnt_ptr": "*i32", "qk_scale": "fp32",
             "eps": "fp32", "window": "i32", "k_sn": "i32", "k_sh": "i32", "v_sn": "i32", "v_sh": "i32"}
elif sys.argv[2] == "fmv_pre":  # the F16 byte matvec, 2 rows, K = 2048 in two steps: the first's weights ahead
    fn = qk._qmatvec_kernel
    consts = dict(N_BLOCKS=2048, QTYPE=1, HAS_RES=False, BM=2, NB=1024, PRE=True, PDL=pdl)
    types = {"w_ptr": "*fp16", "M": "i32", "stride_m": "i32"}
else:  # the Q4_K matvec, 2 rows x 8 blocks, K = 2048
    fn = ik._imv_kernel
    consts = dict(QT=12, U=36, N_BLOCKS=8, R=2, NB=8, T=8, HAS_RES=False, EMU=False, PDL=pdl)
    types = {"w_ptr": "*i32", "w16_ptr": "*i16", "w8_ptr": "*i8", "xh_ptr": "*i64", "xl_ptr": "*i32", "M": "i32"}
params = list(fn.arg_names)
for p in fn.params:  # constexprs left out take their defaults (a kernel's newer switches, off)
    if p.is_constexpr and p.name not in consts and p.default is not inspect.Parameter.empty:
        consts[p.name] = p.default
sig = {p: "constexpr" if p in consts else types.get(p, "*fp32") for p in params}
src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(p),): v for p, v in consts.items()})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def _ptx(kernel: str, pdl: bool) -> str:
    """The PTX of `kernel` (rms_norm, argmax or imv) for sm_90, compiled in a process without the
    interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(int(pdl)), kernel], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.parametrize("kernel", ["rms_norm", "argmax", "imv", "fmv_pre"])
@pytest.mark.parametrize("on", [False, True])
def test_wait_before_the_first_access(kernel: str, on: bool) -> None:
    """A PDL kernel (each starts with `pdl.begin`, or `trigger` / `wait`) compiled for sm_90: with PDL its PTX lets
    the next kernel launch, then waits before it reads anything the kernel before writes and before any store: the
    argmax chunk before its first load; the integer matvec (`_imv_kernel`), the F16 byte matvec with `pre` (the default)
    and the RMSNorm load their weights before the wait (nothing in the step writes them); without PDL neither
    instruction."""
    pre = kernel in ("imv", "rms_norm", "fmv_pre")
    ptx = _ptx(kernel, on)
    first = re.search(r"\b(ld|st)\.global", ptx)
    store = re.search(r"\bst\.global", ptx)
    assert first is not None and store is not None
    if not on:
        assert "griddepcontrol" not in ptx
        return
    trig, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    assert 0 <= trig < wait < store.start()
    assert (first.start() < wait) == pre


def test_step_boundary_and_attention_pre() -> None:
    """sm_90 PTX with PDL: the step's first kernel (embed) waits before it lets the next launch, so nothing of a step
    starts before the step before has finished; the split attention with RoPE reads the length, waits there only
    with one live split, loads its first K / V tile (16 loads: 8 K and 8 V vectors) before its last wait (the short
    phase's early tile) or after it (the long phase's), and only then lets the next kernel launch, and stores; the
    same for the f16 long phase's tensor-core tile (`ATTN_LONG_F16`: its 32-position tile after the wait) and with
    `dot32ae`'s early tile (before it: half the 64-position tile's loads)."""
    ptx = _ptx("embed", True)
    trig, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    first = re.search(r"\b(ld|st)\.global", ptx)
    assert 0 <= wait < trig and first is not None and wait < first.start()
    from moerun.kernels.ops import FEATURE_ARGS
    from moerun.kernels.triton import attention as ak

    tiles = {}
    lf = ak.ATTN_LONG_F16
    f16 = f"{lf.block_n}_{int(lf.early)}_{int(lf.ahead)}_{int(lf.dot)}"  # block_n, early, ahead, dot
    early = "32_1_1_1"
    assert FEATURE_ARGS["dot32ae"]["attn_long_f16"] == lf._replace(early=True)
    for phase in ("short", "long", f16, early):
        ptx = _ptx(f"attn_{phase}", True)
        trig, wait, last = (ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait"),
                            ptx.rfind("griddepcontrol.wait"))
        store = re.search(r"\bst\.global", ptx)
        assert 0 <= wait < last < trig < store.start(), phase
        assert len(re.findall(r"\bld\.global", ptx[:wait])) == 1, phase  # the length
        tile = len(re.findall(r"\bld\.global", ptx[wait:last]))
        tiles[phase] = tile
    assert tiles["short"] >= 16 and tiles["long"] == 0 and tiles[f16] == 0, tiles
    assert tiles[early] == tiles["short"] // 2, tiles


@pytest.mark.parametrize(("gate_up", "down", "min_loads"), [("gate_up_late", "down_route", 2 * 4 * 2),
                                                          ("byte_gate_up_late", "byte_down_route", 2)])
def test_routed_down_pair(gate_up: str, down: str, min_loads: int) -> None:
    """A routed down after its gate/up (the integer kernels and F16's byte kernels, both the default), sm_90 PTX with
    PDL: the gate/up before a routed down lets it launch only after its own wait (so the router's logits are final
    when the down starts) and touches nothing before that wait; the down triggers at once, reads the logits past L1
    (`ld.global.cg`) and its first experts' weights before its wait (integer: 2 experts x 4 blocks x 2 rows at
    least), and stores after it."""
    ptx = _ptx(gate_up, True)
    trig, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    first = re.search(r"\b(ld|st)\.global", ptx)
    assert 0 <= wait < trig and first is not None and wait < first.start()
    ptx = _ptx(down, True)
    trig, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    logits = ptx.find("ld.global.cg")
    loads_before = len(re.findall(r"\bld\.global", ptx[:wait]))
    store = re.search(r"\bst\.global", ptx)
    assert 0 <= trig < logits < wait < store.start()
    assert loads_before > min_loads, f"{loads_before} loads before the wait"
