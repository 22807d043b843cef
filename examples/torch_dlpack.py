#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""moelab's stages on PyTorch tensors, without a copy: ctypes for the C API, DLPack for the tensors.

    python3 examples/torch_dlpack.py [--lib build/libmoelab.so] [--device cuda:0] [--world 4]

runs (a) the experts stage on torch tensors and (b) a whole MoE layer of a simulated world of W
ranks (logits, route, schedule, dispatch, experts, combine: the order of lua/moelab/layer.lua)
through the C API, every tensor torch's but one, and checks both against torch's own computation
(bf16 SwiGLU experts, combine summed in f32), with the tolerances of docs/design.md.  It exits 0
when both pass, 1 on a mismatch, 2 when it cannot run (no torch, no GPU, no library).

The library is --lib, else $MOELAB_LIB, else build/libmoelab.so.  Two modes need no torch:
    --layout     the size and field offsets of every ctypes structure below, one per line
                 (spec/torch_example_spec.lua compares them with the C compiler's)
    --selftest   DLPack and PyCapsule round trips and a small experts call on the CPU

Ownership, as DLPack's Python protocol has it: torch.utils.dlpack.to_dlpack gives a PyCapsule
named "dltensor"; moelab takes the DLManagedTensor inside (moe_tensor_from_dlpack) and the capsule
is renamed "used_dltensor", so that it no longer releases it: moelab calls its deleter when its
tensor is freed.  The other way, moe_tensor_to_dlpack's tensor goes into a new "dltensor" capsule
that torch.utils.dlpack.from_dlpack consumes; a capsule nobody consumes releases it when it dies.

Streams: moelab's context is given the torch stream everything runs on (moe_ctx_set_stream), so
torch's and moelab's work on the same tensors is ordered without a synchronisation.
"""
import argparse
import ctypes
import os
import sys
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint64, c_void_p

# ---------------------------------------------------------------- DLPack's structures (moelab_dlpack.h)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DLDeleter = ctypes.CFUNCTYPE(None, POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DLDeleter)]

# ---------------------------------------------------------------- moelab.h's (a moe_tensor * is a c_void_p)

MOE_F32, MOE_BF16, MOE_I32 = 0, 1, 2
MOE_CPU, MOE_CUDA = 0, 1
MOE_SCORE_SOFTMAX = 0
MOE_LAYOUT_ROUNDROBIN = 0
MOE_SCHED_STATS, MOE_STAT_DROPPED = 5, 2


class moe_device(ctypes.Structure):
    _fields_ = [("kind", c_int), ("index", c_int)]


class moe_route_args(ctypes.Structure):
    _fields_ = [("ids", c_void_p), ("weights", c_void_p), ("stats", c_void_p), ("logits", c_void_p),
                ("bias", c_void_p), ("k", c_int), ("scoring", c_int), ("groups", c_int), ("topk_groups", c_int),
                ("scale", c_float)]


class moe_schedule_args(ctypes.Structure):
    _fields_ = [("peer_rank", c_void_p), ("peer_route", c_void_p), ("counts", c_void_p),
                ("tokens_per_expert", c_void_p), ("expert_offsets", c_void_p), ("route_row", c_void_p),
                ("stats", c_void_p), ("ids", c_void_p), ("experts", c_int), ("rank", c_int), ("pad", c_int),
                ("capacity", c_int), ("expert_capacity", c_int), ("layout", c_int)]


class moe_dispatch_args(ctypes.Structure):
    _fields_ = [("out", c_void_p), ("x", c_void_p), ("peer_rank", c_void_p), ("peer_route", c_void_p),
                ("k", c_int), ("zero_fill", c_int)]


class moe_experts_args(ctypes.Structure):
    _fields_ = [("out", c_void_p), ("x", c_void_p), ("offsets", c_void_p), ("w_gate_up", c_void_p),
                ("w_down", c_void_p)]


class moe_combine_args(ctypes.Structure):
    _fields_ = [("out", c_void_p), ("weights", c_void_p), ("ids", c_void_p), ("ys", POINTER(c_void_p)),
                ("route_row", POINTER(c_void_p)), ("world", c_int), ("experts", c_int), ("rank", c_int),
                ("shared", c_void_p), ("shared_gate", c_void_p)]


# What --layout prints: each structure by its C name, which is its class's name.
STRUCTURES = [DLDevice, DLDataType, DLTensor, DLManagedTensor, moe_device, moe_route_args, moe_schedule_args,
              moe_dispatch_args, moe_experts_args, moe_combine_args]

# The functions used here: name -> (result, argument types).
PROTOTYPES = {
    "moe_libversion": (c_char_p, []),
    "moe_errmsg": (c_char_p, [c_void_p]),
    "moe_ctx_open": (c_int, [POINTER(c_void_p)]),
    "moe_ctx_close": (None, [c_void_p]),
    "moe_ctx_set_stream": (c_int, [c_void_p, c_void_p]),
    "moe_tensor_new": (c_int, [c_void_p, c_int, c_int, POINTER(c_int64), moe_device, POINTER(c_void_p)]),
    "moe_tensor_view": (c_int, [c_void_p, c_void_p, c_int64, c_int, POINTER(c_int64), POINTER(c_void_p)]),
    "moe_tensor_free": (None, [c_void_p]),
    "moe_tensor_data": (c_void_p, [c_void_p]),
    "moe_tensor_from_dlpack": (c_int, [c_void_p, c_void_p, POINTER(c_void_p)]),
    "moe_tensor_to_dlpack": (c_int, [c_void_p, c_void_p, POINTER(POINTER(DLManagedTensor))]),
    "moe_f32_to_bf16": (c_uint16, [c_float]),
    "moe_bf16_to_f32": (c_float, [c_uint16]),
    "moe_logits": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
    "moe_route": (c_int, [c_void_p, POINTER(moe_route_args)]),
    "moe_schedule": (c_int, [c_void_p, POINTER(moe_schedule_args)]),
    "moe_dispatch": (c_int, [c_void_p, POINTER(moe_dispatch_args)]),
    "moe_experts": (c_int, [c_void_p, POINTER(moe_experts_args)]),
    "moe_combine": (c_int, [c_void_p, POINTER(moe_combine_args)]),
}

# ---------------------------------------------------------------- PyCapsules, as DLPack names them

# The names live as long as the process: a capsule keeps the pointer it was given, not a copy.
DLTENSOR = b"dltensor"
USED_DLTENSOR = b"used_dltensor"

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = c_void_p, [ctypes.py_object, c_char_p]
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.restype, _capsule_set_name.argtypes = c_int, [ctypes.py_object, c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype, _capsule_is_valid.argtypes = c_int, [ctypes.py_object, c_char_p]
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [c_void_p, c_char_p, c_void_p]

# A capsule's destructor gets the dying capsule as a bare pointer: no Python reference may be made
# of it, so these two take it as an address.
_dying_is_valid = ctypes.PYFUNCTYPE(c_int, c_void_p, c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_dying_pointer = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))


@ctypes.CFUNCTYPE(None, c_void_p)
def _release_unconsumed(capsule):
    # still "dltensor": no consumer took the export, whose deleter is then ours to call
    if _dying_is_valid(capsule, DLTENSOR):
        managed = ctypes.cast(_dying_pointer(capsule, DLTENSOR), POINTER(DLManagedTensor))
        managed.contents.deleter(managed)


# ---------------------------------------------------------------- the library


class Moelab:
    """libmoelab through ctypes: a context, and the moelab tensors made on it (freed by close)."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        for name, (result, argtypes) in PROTOTYPES.items():
            f = getattr(self.lib, name)
            f.restype, f.argtypes = result, argtypes
        self.ctx = c_void_p()
        if self.lib.moe_ctx_open(byref(self.ctx)):
            raise RuntimeError("moe_ctx_open failed")
        self.tensors = []

    def check(self, rc, what):
        if rc:
            raise RuntimeError("%s: %s" % (what, self.lib.moe_errmsg(self.ctx).decode()))

    def keep(self, handle):
        self.tensors.append(handle)
        return handle

    def from_capsule(self, capsule):
        """A moelab tensor that owns the DLManagedTensor of a "dltensor" capsule."""
        managed = _capsule_pointer(capsule, DLTENSOR)  # raises if the capsule was consumed already
        out = c_void_p()
        # refused: the capsule keeps its name, and with it the duty to release the tensor
        self.check(self.lib.moe_tensor_from_dlpack(self.ctx, managed, byref(out)), "moe_tensor_from_dlpack")
        _capsule_set_name(capsule, USED_DLTENSOR)
        return self.keep(out.value)

    def to_capsule(self, handle):
        """A "dltensor" capsule of a new DLPack export of a moelab tensor."""
        managed = POINTER(DLManagedTensor)()
        self.check(self.lib.moe_tensor_to_dlpack(self.ctx, handle, byref(managed)), "moe_tensor_to_dlpack")
        return _capsule_new(ctypes.cast(managed, c_void_p), DLTENSOR, ctypes.cast(_release_unconsumed, c_void_p))

    def new(self, dtype, shape, device):
        out = c_void_p()
        self.check(self.lib.moe_tensor_new(self.ctx, dtype, len(shape), (c_int64 * len(shape))(*shape), device,
                                           byref(out)), "moe_tensor_new")
        return self.keep(out.value)

    def view(self, base, offset, shape):
        out = c_void_p()
        self.check(self.lib.moe_tensor_view(self.ctx, base, offset, len(shape), (c_int64 * len(shape))(*shape),
                                            byref(out)), "moe_tensor_view")
        return self.keep(out.value)

    def free(self, handle):
        self.tensors.remove(handle)
        self.lib.moe_tensor_free(handle)

    def close(self):
        for handle in self.tensors:
            self.lib.moe_tensor_free(handle)
        self.tensors = []
        self.lib.moe_ctx_close(self.ctx)


# ---------------------------------------------------------------- checks, as docs/design.md states them

RTOL, L2 = 2e-2, 1e-2


def report(what, got, ref, rtol=RTOL, l2=L2):
    """max |got - ref| <= rtol max |ref| and relative L2 <= l2, no NaN; prints the numbers, returns pass."""
    err = (got - ref).abs()
    max_err, max_ref = err.max().item(), ref.abs().max().item()
    rel_l2 = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    finite = bool(got.isfinite().all().item())
    ok = finite and max_err <= rtol * max_ref and rel_l2 <= l2
    print("%-34s max err %.3e vs tolerance %.3e (%.0e x max |ref| %.3e); relative L2 %.3e vs %.0e%s: %s"
          % (what, max_err, rtol * max_ref, rtol, max_ref, rel_l2, l2, "" if finite else "; NaN or inf",
             "PASS" if ok else "FAIL"))
    return ok


def expert_reference(torch, x, w_gate_up, w_down):
    """bf16 [N, H] rows through one expert as docs/design.md defines it: f32 sums, h rounded to bf16,
    the output rounded to bf16."""
    F = w_gate_up.shape[0] // 2
    xf = x.float()
    g = xf @ w_gate_up[:F].float().T
    u = xf @ w_gate_up[F:].float().T
    h = (torch.nn.functional.silu(g) * u).to(torch.bfloat16).float()
    return (h @ w_down.float().T).to(torch.bfloat16)


# ---------------------------------------------------------------- (a) the experts stage on torch tensors


def run_experts(torch, m, dev):
    C, H, F, EL = 1000, 512, 256, 6
    sizes = [300, 0, 17, 256, 129, 200]  # an empty expert, odd sizes; 98 rows past the last offset
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(C, H, generator=gen).to(dev, torch.bfloat16)
    w_gate_up = (torch.randn(EL, 2 * F, H, generator=gen) * H ** -0.5).to(dev, torch.bfloat16)
    w_down = (torch.randn(EL, H, F, generator=gen) * F ** -0.5).to(dev, torch.bfloat16)
    off = torch.tensor(offsets, dtype=torch.int32, device=dev)
    out = torch.full((C, H), 7.0, dtype=torch.bfloat16, device=dev)  # torch's memory: moelab writes it

    def mt(t):
        return m.from_capsule(torch.utils.dlpack.to_dlpack(t))

    args = moe_experts_args(out=mt(out), x=mt(x), offsets=mt(off), w_gate_up=mt(w_gate_up), w_down=mt(w_down))
    m.check(m.lib.moe_experts(m.ctx, byref(args)), "moe_experts")

    ref = torch.empty_like(out)
    for e in range(EL):
        a, b = offsets[e], offsets[e + 1]
        ref[a:b] = expert_reference(torch, x[a:b], w_gate_up[e], w_down[e])
    used = offsets[-1]
    ok = report("experts, %d rows of %d experts" % (used, EL), out[:used].float(), ref[:used].float())
    untouched = bool((out[used:] == 7.0).all().item())
    print("%-34s %s" % ("experts, rows past the last offset", "untouched: PASS" if untouched else "written: FAIL"))
    return ok and untouched


# ---------------------------------------------------------------- (b) a whole layer through the C API


def run_layer(torch, m, dev, device, W):
    T, H, F, K, pad = 96, 256, 128, 4, 8
    E = 8 * W
    EL = E // W
    C = W * T * K + EL * pad  # every route of the world on one rank, padded: nothing is dropped
    gen = torch.Generator(device="cpu").manual_seed(2)
    x = torch.randn(W, T, H, generator=gen).to(dev, torch.bfloat16)
    w_router = (torch.randn(E, H, generator=gen) * H ** -0.5).to(dev, torch.bfloat16)
    w_gate_up = [(torch.randn(EL, 2 * F, H, generator=gen) * H ** -0.5).to(dev, torch.bfloat16) for _ in range(W)]
    w_down = [(torch.randn(EL, H, F, generator=gen) * F ** -0.5).to(dev, torch.bfloat16) for _ in range(W)]

    def mt(t):
        return m.from_capsule(torch.utils.dlpack.to_dlpack(t))

    def empty(*shape, dtype=torch.int32):
        return torch.empty(*shape, dtype=dtype, device=dev)

    # 1. route every rank's tokens at once: logits = x w_router^T, then softmax top-K
    logits, ids, weights = empty(W * T, E, dtype=torch.float32), empty(W * T, K), empty(W * T, K, dtype=torch.float32)
    route_stats = empty(2)
    m.check(m.lib.moe_logits(m.ctx, mt(logits), mt(x.view(W * T, H)), mt(w_router)), "moe_logits")
    ra = moe_route_args(ids=mt(ids), weights=mt(weights), stats=mt(route_stats), logits=mt(logits), bias=None, k=K,
                        scoring=MOE_SCORE_SOFTMAX, groups=1, topk_groups=1, scale=1.0)
    m.check(m.lib.moe_route(m.ctx, byref(ra)), "moe_route")

    # 2.-4. each rank: its schedule of all ids, dispatch of every rank's tokens, its experts
    all_ids = mt(ids.view(W, T, K))
    x_all = mt(x)
    ys, route_rows, sched_stats = [], [], []
    for r in range(W):
        s = {"peer_rank": empty(C), "peer_route": empty(C), "counts": empty(EL), "tokens_per_expert": empty(EL),
             "expert_offsets": empty(EL + 1), "route_row": empty(W, T * K), "stats": empty(MOE_SCHED_STATS)}
        sa = moe_schedule_args(ids=all_ids, experts=E, rank=r, pad=pad, capacity=C, expert_capacity=-1,
                               layout=MOE_LAYOUT_ROUNDROBIN, **{k: mt(v) for k, v in s.items()})
        m.check(m.lib.moe_schedule(m.ctx, byref(sa)), "moe_schedule")
        xs = torch.empty(C, H, dtype=torch.bfloat16, device=dev)
        da = moe_dispatch_args(out=mt(xs), x=x_all, peer_rank=sa.peer_rank, peer_route=sa.peer_route, k=K, zero_fill=1)
        m.check(m.lib.moe_dispatch(m.ctx, byref(da)), "moe_dispatch")
        y = torch.empty(C, H, dtype=torch.bfloat16, device=dev)
        ea = moe_experts_args(out=mt(y), x=da.out, offsets=sa.expert_offsets, w_gate_up=mt(w_gate_up[r]),
                              w_down=mt(w_down[r]))
        m.check(m.lib.moe_experts(m.ctx, byref(ea)), "moe_experts")
        ys.append(ea.out)
        route_rows.append(sa.route_row)
        sched_stats.append(s["stats"])

    # 5. combine, summed in f32, into memory moelab allocates, handed to torch afterwards
    out = m.new(MOE_F32, [W, T, H], moe_device(MOE_CUDA, device))
    ys_list, rr_list = (c_void_p * W)(*ys), (c_void_p * W)(*route_rows)
    ids3, weights3 = ids.view(W, T, K), weights.view(W, T, K)
    for p in range(W):
        ca = moe_combine_args(out=m.view(out, p * T * H, [T, H]), weights=mt(weights3[p]), ids=mt(ids3[p]),
                              ys=ys_list, route_row=rr_list, world=W, experts=E, rank=p, shared=None, shared_gate=None)
        m.check(m.lib.moe_combine(m.ctx, byref(ca)), "moe_combine")
    got = torch.utils.dlpack.from_dlpack(m.to_capsule(out))
    m.free(out)  # the export holds the memory now: it goes when torch's tensor does

    # the checks, in torch
    ok = True
    dropped = sum(int(st[MOE_STAT_DROPPED].item()) for st in sched_stats)
    unscored = int(route_stats[0].item())
    print("%-34s %d unscored rows, %d dropped routes: %s" % ("layer, route and schedule", unscored, dropped,
                                                           "PASS" if unscored == dropped == 0 else "FAIL"))
    ok = ok and unscored == dropped == 0
    ref_logits = x.view(W * T, H).float() @ w_router.float().T
    ok = report("layer, router logits", logits, ref_logits, rtol=1e-4, l2=1e-5) and ok
    # the route of moelab's own logits: torch's softmax top-K (ties are improbable in random data)
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = probs.topk(K, dim=-1)
    want_ids, order = top_i.sort(dim=-1)
    want_w = (top_p / top_p.sum(dim=-1, keepdim=True)).gather(-1, order)
    got_ids, got_order = ids.long().sort(dim=-1)
    same_ids = bool((got_ids == want_ids).all().item())
    print("%-34s %s" % ("layer, routed experts", "equal to torch's top-K: PASS" if same_ids else "differ: FAIL"))
    ok = ok and same_ids
    ok = report("layer, routing weights", weights.gather(-1, got_order), want_w, rtol=1e-4, l2=1e-5) and ok
    # the layer: out[t] = sum over k of w[t, k] * expert_{id[t, k]}(x[t]), the expert output bf16
    ref = torch.zeros(W * T, H, dtype=torch.float32, device=dev)
    xr = x.view(W * T, H)
    for e in range(E):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y = expert_reference(torch, xr[rows], w_gate_up[e // EL][e % EL], w_down[e // EL][e % EL]).float()
            ref.index_add_(0, rows, weights[rows, slot].unsqueeze(1) * y)
    ok = report("layer, %d ranks x %d tokens" % (W, T), got.view(W * T, H), ref) and ok
    return ok


# ---------------------------------------------------------------- the modes


def layout():
    for s in STRUCTURES:
        print("%s %d" % (s.__name__, ctypes.sizeof(s)))
        for name, _ in s._fields_:
            print("%s.%s %d" % (s.__name__, name, getattr(s, name).offset))


def selftest(m):
    """Without torch: an export through a capsule and back on the CPU, and experts through the
    argument structure, on the hand-checked case of spec/c/test_stages.c."""
    cpu = moe_device(MOE_CPU, 0)
    t = m.new(MOE_F32, [2, 3], cpu)
    values = [1.0, -2.0, 3.5, 4.0, 5.0, 6.25]
    (c_float * 6).from_address(m.lib.moe_tensor_data(t))[:] = values
    capsule = m.to_capsule(t)
    m.free(t)  # the export holds the memory
    u = m.from_capsule(capsule)
    problems = []
    if list((c_float * 6).from_address(m.lib.moe_tensor_data(u))) != values:
        problems.append("the round trip lost the values")
    if not _capsule_is_valid(capsule, USED_DLTENSOR):
        problems.append("a consumed capsule is not renamed used_dltensor")
    try:
        m.from_capsule(capsule)
        problems.append("a used capsule was taken twice")
    except ValueError:
        pass  # PyCapsule_GetPointer: the name is not "dltensor" any more
    del capsule

    # experts: rows 0-1 expert 0, row 2 expert 2, row 3 past the last offset (left as it was)
    def bf16(shape, vals):
        h = m.new(MOE_BF16, shape, cpu)
        n = len(vals)
        (c_uint16 * n).from_address(m.lib.moe_tensor_data(h))[:] = [m.lib.moe_f32_to_bf16(v) for v in vals]
        return h

    off = m.new(MOE_I32, [4], cpu)
    (c_int32 * 4).from_address(m.lib.moe_tensor_data(off))[:] = [0, 2, 2, 3]
    out = bf16([4, 2], [-9.0] * 8)
    a = moe_experts_args(out=out, x=bf16([4, 2], [2, 3, -1, 0.5, 4, 2, 1, 1]), offsets=off,
                         w_gate_up=bf16([3, 2, 2], [1, 0, 0, 1, 7, 7, 7, 7, 0.5, 0.5, 1, -1]),
                         w_down=bf16([3, 2, 1], [1, -2, 7, 7, 0.25, 4]))
    m.check(m.lib.moe_experts(m.ctx, byref(a)), "moe_experts")
    got = [m.lib.moe_bf16_to_f32(v) for v in (c_uint16 * 8).from_address(m.lib.moe_tensor_data(out))]
    if got != [5.28125, -10.5625, -0.134765625, 0.26953125, 1.4296875, 22.875, -9.0, -9.0]:
        problems.append("experts gave %s" % got)
    for p in problems:
        print("selftest: " + p)
    print("selftest: %s" % ("FAIL" if problems else "PASS"))
    return not problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=os.environ.get("MOELAB_LIB", "build/libmoelab.so"))
    ap.add_argument("--device", default="cuda:0", help="the GPU, cuda:N")
    ap.add_argument("--world", type=int, default=4, help="ranks of the simulated world (W >= 1)")
    ap.add_argument("--layout", action="store_true", help="print the ctypes structures' layouts and exit")
    ap.add_argument("--selftest", action="store_true", help="round trips on the CPU, no torch needed")
    o = ap.parse_args()
    if o.layout:
        layout()
        return 0
    if o.world < 1 or not o.device.startswith("cuda:") or not o.device[5:].isdigit():
        print("torch_dlpack.py: --world must be >= 1 and --device cuda:N", file=sys.stderr)
        return 2
    try:
        m = Moelab(o.lib)
    except OSError as e:
        print("torch_dlpack.py: cannot load %s (--lib or MOELAB_LIB): %s" % (o.lib, e), file=sys.stderr)
        return 2
    print("moelab %s from %s" % (m.lib.moe_libversion().decode(), o.lib))
    if o.selftest:
        ok = selftest(m)
        m.close()
        return 0 if ok else 1
    try:
        import torch
        import torch.utils.dlpack
    except ImportError:
        print("torch_dlpack.py: PyTorch is not installed (--selftest runs without it)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("torch_dlpack.py: torch sees no GPU", file=sys.stderr)
        return 2
    device = int(o.device[5:])
    dev = torch.device(o.device)
    # the references' f32 products in f32, not TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    stream = torch.cuda.Stream(device=dev)
    m.check(m.lib.moe_ctx_set_stream(m.ctx, c_void_p(stream.cuda_stream)), "moe_ctx_set_stream")
    try:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            ok = run_experts(torch, m, dev)
            ok = run_layer(torch, m, dev, device, o.world) and ok
    except RuntimeError as e:  # a call moelab refused: its message names the call and the argument
        print("torch_dlpack.py: %s" % e, file=sys.stderr)
        ok = False
    stream.synchronize()
    m.close()  # moelab's tensors go; each calls its torch tensor's deleter
    print("torch_dlpack.py: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
