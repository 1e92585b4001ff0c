"""scripts/bench_chain.py on CPU: the smoke path in Triton's interpreter (plain, pdl and read against the float64
reference), the shape errors, the checks' power to fail, the persistent kernel's bookkeeping with a one-program
grid (and its timeout report), the counter-carried ``flag`` launches' bookkeeping, the ``stream`` execution's
host-side plan (its tiles and work lists, emulated in float64), and the sm_90 compile with the PTX orderings its
protocols rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, load_script

SCRIPT = ROOT / "scripts" / "bench_chain.py"
SMOKE = ["--device", "cpu", "--shapes", "64x128,128x64", "--layers", "4", "--bn", "16", "--bk", "32", "--reps", "2"]

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def bc():
    return load_script("bench_chain")


def _interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (conftest sets it on machines without CUDA)")


def test_cpu_smoke_matches_float64(bc, tmp_path):
    """The documented CPU smoke run: plain and pdl within the bounds of the float64 chain and of each op's own
    float64 product, pdl == plain bit for bit, the read floor's XOR equal to the host's, persist skipped with its
    reason, stream left out unless named and then skipped with its reason, and the JSON written with the table's
    fields and the config."""
    _interpreted()
    lines = []
    rec = bc.main(SMOKE + ["--out", str(tmp_path), "--name", "smoke"], log=lines.append)
    res = rec["results"]
    assert rec["ok"]
    for name in ("plain", "pdl"):
        r = res[name]
        assert r["ok"] and r["chain_err_max_over_bound"] <= 1.0 and r["local_err_max_over_bound"] <= 1.0, (name, r)
        assert r["local_err_max"] == 0.0        # K <= 128: float32 sums round to the float64 result's bf16
    assert res["pdl"]["bit_equal_plain"] is True
    for name in ("flag", "flaglate"):          # the counter-carried dependency: the same bits as plain
        assert res[name]["ok"] and res[name]["bit_equal_plain"] is True, (name, res[name])
    assert res["read"]["ok"] and res["read"]["grid"] > 0
    assert "interpreter" in res["persist"]["skipped"]
    assert any(ln.startswith("persist") and "skipped" in ln for ln in lines)
    assert "stream" not in res and "streamfree" not in res      # not in the default --only: they must be named
    named = bc.main(SMOKE + ["--only", "read,stream,streamfree", "--out", str(tmp_path), "--name", "smoke-stream"],
                    log=lines.append)["results"]
    assert "interpreter" in named["stream"]["skipped"] and "interpreter" in named["streamfree"]["skipped"]
    assert named["read"]["ok"]
    data = json.loads((tmp_path / "smoke.json").read_text())
    meta = data["meta"]
    for k in ("device", "date", "commit", "weights", "shapes", "L", "weight_bytes"):
        assert meta[k], k
    assert meta["weights"] == "synthetic (random FP8)" and meta["L"] == 4
    assert {"bn": 16, "bk": 32, "num_warps": 4, "programs_per_sm": 1}.items() <= meta["config"].items()
    for name in ("plain", "pdl", "read"):
        for k in ("us", "us_per_op", "GBps", "us_per_op_over_floor"):
            assert data["results"][name][k] is not None, (name, k)


def test_wrong_shapes_raise_a_clear_error(bc):
    with pytest.raises(bc.ShapeError, match=r"op 1 \(64x64\) has K = 64 but op 0 \(64x128\) produces N = 128"):
        bc.parse_shapes("64x128,64x64", 4)
    with pytest.raises(bc.ShapeError, match=r"op 2 \(64x128\) has K = 64 but op 1"):   # where the pattern repeats
        bc.parse_shapes("64x128,128x128", 3)
    with pytest.raises(bc.ShapeError, match="not KxN"):
        bc.parse_shapes("64-128", 2)
    with pytest.raises(bc.ShapeError, match="multiple of --bn 16"):
        bc.check_tiles([(64, 120)], 16, 32)
    with pytest.raises(bc.ShapeError, match="K = 64 but op 0"):
        bc.main(["--device", "cpu", "--shapes", "64x128,64x64", "--layers", "2"], log=lambda *a: None)
    assert bc.parse_shapes("2560x16384,16384x2560", 5) == [(2560, 16384), (16384, 2560)] * 2 + [(2560, 16384)]


@pytest.fixture(scope="module")
def small(bc):
    ops = bc.parse_shapes("64x128,128x64", 4)
    chain = bc.make_chain(ops, torch.device("cpu"), 16, seed=3)
    return chain, bc.Config(bn=16, bk=32, max_polls=64), bc.chain_reference(chain)


def test_checks_can_fail(bc, small):
    """The row block holding an op's largest value 3 % off, or one block left unwritten (NaN), fails the checks
    that pass on the true outputs."""
    _interpreted()
    chain, cfg, ref = small
    chain.poison()
    bc.run_plain(chain, cfg, False)
    ys = chain.outputs()
    assert bc.check_outputs(chain, ys, ref)["ok"]
    bad = [y.clone() for y in ys]
    b0 = int(bad[2].float().abs().argmax()) // 16 * 16
    bad[2][b0:b0 + 16] = (bad[2][b0:b0 + 16].float() * 1.03).to(torch.bfloat16)
    r = bc.check_outputs(chain, bad, ref)
    assert not r["ok"] and r["local_err_max_over_bound"] > 1.0
    bad = [y.clone() for y in ys]
    bad[1][:16] = float("nan")
    assert not bc.check_outputs(chain, bad, ref)["ok"]


def test_persist_bookkeeping_in_the_interpreter(bc, small):
    """A one-program grid (the only one the interpreter can run: no wait ever blocks) walks the op table and
    equals plain bit for bit, every counter = its op's row blocks. With 3 programs the first ones time out at op 1
    (the interpreter runs them in turn): persist_check raises the clear error, and the counters still show every
    block computed exactly once by the round robin (8 blocks over a stride of 3)."""
    _interpreted()
    chain, cfg, _ = small
    chain.poison()
    bc.run_plain(chain, cfg, False)
    plain = chain.outputs()
    st = bc.persist_setup(chain, cfg, programs=1)
    chain.poison()
    bc.run_persist(chain, cfg, st)
    bc.persist_check(chain, st)
    assert all(torch.equal(a, b) for a, b in zip(chain.outputs(), plain))
    assert st.cnt.tolist() == [8, 4, 8, 4]
    st = bc.persist_setup(chain, cfg, programs=3)
    bc.run_persist(chain, cfg, st)
    with pytest.raises(RuntimeError, match=r"spin wait\(s\) timed out .*last at op 1"):
        bc.persist_check(chain, st)
    assert st.cnt.tolist() == [8, 4, 8, 4]


def test_flag_bookkeeping_and_timeout(bc, small):
    """``flag``: every op's counter ends at its row blocks and the outputs equal plain's; an op launched while its
    predecessor's counter is short (op 1 alone after a reset) times out and flag_check names it."""
    _interpreted()
    chain, cfg, _ = small
    chain.poison()
    bc.run_plain(chain, cfg, False)
    plain = chain.outputs()
    st = bc.flag_setup(chain)
    chain.poison()
    bc.run_flag(chain, cfg, st, late=False)
    bc.flag_check(chain, st)
    assert st.cnt.tolist() == [0, 8, 4, 8, 4]
    assert all(torch.equal(a, b) for a, b in zip(chain.outputs(), plain))
    st.cnt.zero_()
    k, n = chain.ops[1]
    bc._gemv_flag[(n // cfg.bn,)](chain.weight(1), chain.scale(1), chain.x(1), chain.y(1), st.cnt[1:], st.err,
                                  chain.ops[0][1] // cfg.bn, 1, K=k, BN=cfg.bn, BK=cfg.bk, FIRST=False, LATE=False,
                                  MAX_POLLS=cfg.max_polls, HW=False, NT=32 * cfg.num_warps)
    with pytest.raises(RuntimeError, match=r"flag: 4 spin wait\(s\) timed out .*last at op 1"):
        bc.flag_check(chain, st)


@pytest.fixture(scope="module")
def cs():
    return load_script("chain_stream")


def _emulate_stream(bc, st, chain) -> list[torch.Tensor]:
    """What the stream kernel computes, from its host-side plan alone: each program walks its items in order and
    takes its tiles from ``tiles`` one after another (its ring's order), each tile read from the repacked buffer;
    ops in chain order (the counters' order), x at the offset the op table names in the execution's activation
    buffer. float64 sums, then ``bf16(s * rowsum)``. Also checks that every program consumes exactly its own tile
    list."""
    r = st.rows
    plan = {k: v.tolist() for k, v in st.plan.items()}
    w8 = st.packed.view(torch.float8_e4m3fn).view(-1, r, 128).double()
    cursor = list(plan["tile_start"][:-1])
    act = st.act.double().clone()
    for i, (k, n) in enumerate(chain.ops):
        xo, yo = plan["meta"][i][2], plan["meta"][i][3]
        x = act[xo:xo + k].clone()
        for p in range(st.grid):
            for it in range(plan["item_start"][p], plan["item_start"][p + 1]):
                op, blk = plan["items"][it]
                if op != i:
                    continue
                acc = torch.zeros(r, dtype=torch.float64)
                for c in range(k // 128):
                    acc += w8[plan["tiles"][cursor[p]]] @ x[128 * c:128 * c + 128]
                    cursor[p] += 1
                y = (acc * chain.scale(i)[blk * r:blk * r + r].double()).to(torch.bfloat16).double()
                act[yo + blk * r:yo + blk * r + r] = y
    assert cursor == plan["tile_start"][1:], "a program's tile list does not match its items"
    return [act[o:o + n].to(torch.bfloat16) for o, (_, n) in zip(st.y_off, chain.ops)]


def _emulate_stream_split(bc, st, chain) -> list[torch.Tensor]:
    """What the stream kernel computes with ``ksplit > 1`` (the ``mma`` consumer), from its host-side plan alone:
    each item (op, row block x ksplit + part) sums its part's tiles (taken from ``tiles`` in the program's order)
    against x in float64 and stores the float32 partial where the op table's partial offset puts it; op i > 0's x is
    formed from op i - 1's partials as the kernel forms it (float32 adds in part order, times the row scale, BF16,
    then FP16: exact). The outputs come from :meth:`Stream.outputs`, the method under test."""
    r, ks = st.rows, st.ksplit
    plan = {k: v.tolist() for k, v in st.plan.items()}
    w8 = st.packed.view(torch.float8_e4m3fn).view(-1, r, 128).double()
    cursor = list(plan["tile_start"][:-1])
    st.part.fill_(float("nan"))
    for i, (k, n) in enumerate(chain.ops):
        if i == 0:
            x = st.act[plan["meta"][0][2]:plan["meta"][0][2] + k].double()
        else:
            pk, po = chain.ops[i - 1][1], plan["meta"][i - 1][7]
            xs = st.part[po:po + pk].clone()
            for q in range(1, ks):
                xs = xs + st.part[po + q * pk:po + (q + 1) * pk]
            x = (xs * chain.scale(i - 1)).to(torch.bfloat16).to(torch.float16).double()
        npart = k // 128 // ks
        for p in range(st.grid):
            for it in range(plan["item_start"][p], plan["item_start"][p + 1]):
                op, bq = plan["items"][it]
                if op != i:
                    continue
                blk, q = divmod(bq, ks)
                acc = torch.zeros(r, dtype=torch.float64)
                for c in range(q * npart, (q + 1) * npart):
                    acc += w8[plan["tiles"][cursor[p]]] @ x[128 * c:128 * c + 128]
                    cursor[p] += 1
                o = plan["meta"][i][7] + q * n + blk * r
                st.part[o:o + r] = acc.float()
    assert cursor == plan["tile_start"][1:], "a program's tile list does not match its items"
    assert not torch.isnan(st.part).any(), "a partial was never written"
    return st.outputs(chain)


def test_stream_split_over_k(bc, cs):
    """``--stream-ksplit`` (the ``mma`` consumer): every (op, row block, K part) is one item of exactly one program,
    in op order; an item's tiles are its part's consecutive tiles of the block; the programs' tile counts stay
    within one item of each other; the partial offsets tile one buffer of ``part_elems`` floats; a float64
    emulation over that plan, with x formed from the partials as the kernel forms it and y from
    :meth:`Stream.outputs`, is within the chain's float64 bounds; the counters expect blocks x ksplit items; and
    the settings the split cannot take are named errors."""
    cpu = torch.device("cpu")
    ops = [(512, 256), (256, 512), (512, 256)]
    chain = bc.make_chain(ops, cpu, 16, seed=4)
    with pytest.raises(cs.StreamError, match="above 1 only with --stream-consumer mma"):
        cs.Stream(chain, 16, 1, 4, 1, 64, programs=3, ksplit=2)
    with pytest.raises(cs.StreamError, match="a power of two"):
        cs.Stream(chain, 16, 1, 4, 1, 64, programs=3, consumer="mma", ksplit=3)
    with pytest.raises(cs.StreamError, match="--stream-ksplit 4 must divide"):
        cs.Stream(chain, 16, 1, 4, 1, 64, programs=3, consumer="mma", ksplit=4)      # K / 128 = 2 for op 1
    with pytest.raises(cs.StreamError, match="--stream-cps 2 must divide every K / 128 / ksplit"):
        cs.Stream(chain, 16, 2, 4, 1, 64, programs=3, consumer="mma", ksplit=2)
    st = cs.Stream(chain, 16, 1, 4, 1, 64, programs=3, consumer="mma", ksplit=2)
    items = [tuple(v) for v in st.plan["items"].tolist()]
    assert sorted(items) == sorted((i, bq) for i, (_, n) in enumerate(ops) for bq in range(n // 16 * 2))
    starts, tl, ts = st.plan["item_start"].tolist(), st.plan["tiles"].tolist(), st.plan["tile_start"].tolist()
    base = st.plan["meta"][:, 0].tolist()
    for p in range(3):
        mine = items[starts[p]:starts[p + 1]]
        assert [op for op, _ in mine] == sorted(op for op, _ in mine)
        want = []
        for op, bq in mine:
            nc = ops[op][0] // 128
            b, q = divmod(bq, 2)
            want += list(range(base[op] + b * nc + q * nc // 2, base[op] + b * nc + (q + 1) * nc // 2))
        assert tl[ts[p]:ts[p + 1]] == want
    counts = [ts[p + 1] - ts[p] for p in range(3)]
    assert max(counts) - min(counts) <= max(k // 128 // 2 for k, _ in ops), counts
    assert st.plan["meta"][:, 7].tolist() == [0, 2 * 256, 2 * (256 + 512)]
    assert st.part.numel() == cs.part_elems(ops, 2) == 2 * (256 + 512 + 256)
    assert st.plan["meta"][:, 6].tolist() == [0, 256 // 16 * 2, 512 // 16 * 2]
    res = bc.check_outputs(chain, _emulate_stream_split(bc, st, chain), bc.chain_reference(chain))
    assert res["ok"], res
    st.cnt.copy_(torch.tensor([n // 16 * 2 for _, n in ops], dtype=torch.int32))
    st.check(chain)
    st.poison(chain)
    assert torch.isnan(st.part).all()


def test_stream_plan_tiles_and_balance(bc, cs):
    """The ``stream`` execution's host side (the kernel itself needs a GPU): the settings it cannot tile are named
    errors; every (op, row block) goes to exactly one program, each program's items are in op order, each tile
    holds the right 16 x 128 bytes of its op's weight; a float64 emulation of the plan (each program's tiles
    consumed in its ring's order) is within bench_chain's float64-chain bounds; the least-loaded assignment keeps
    the programs' tile counts within one block of each other over the chain; the counter check passes on N / R per op
    and names a miscount and a timeout; in ``streamfree``'s plan every op reads the same input, in a buffer of
    its own, and its
    per-op check passes on the emulated outputs and fails on a block 5 % off."""
    cpu = torch.device("cpu")
    with pytest.raises(cs.StreamError, match="K must be a multiple of 128"):
        cs.Stream(bc.make_chain([(256, 144), (144, 256)], cpu, 16), 16, 1, 4, 4, 64, programs=3)
    ops = [(256, 128), (128, 256), (256, 384), (384, 128)]
    chain = bc.make_chain(ops, cpu, 16, seed=5)
    with pytest.raises(cs.StreamError, match="--stream-cps 2 must divide"):
        cs.Stream(chain, 16, 2, 4, 4, 64, programs=3)
    with pytest.raises(cs.StreamError, match="shared memory"):
        cs.Stream(chain, 16, 1, 200, 4, 64, programs=3)
    for rows in (4, 24):        # under the swizzle's 8-row period (ptxas' caller aborts on it); not a power of two
        with pytest.raises(cs.StreamError, match="power of two"):
            cs.Stream(chain, rows, 1, 4, 4, 64, programs=3)
    with pytest.raises(cs.StreamError, match="at most 256 rows"):      # a stage of 16 tiles x 32 rows
        cs.Stream(bc.make_chain([(2048, 64)], cpu, 16), 32, 16, 2, 4, 64, programs=3)
    # the mma consumer: a 16-row mma tile per warp, so R a multiple of 16 x warps; an unknown consumer is named
    with pytest.raises(cs.StreamError, match="multiple of 16 x num_warps"):
        cs.Stream(chain, 16, 1, 4, 2, 64, programs=3, consumer="mma")
    with pytest.raises(cs.StreamError, match="one of fma, mma"):
        cs.Stream(chain, 16, 1, 4, 4, 64, programs=3, consumer="wgmma")
    assert cs.Stream(chain, 32, 1, 4, 2, 64, programs=3, consumer="mma").consumer == "mma"
    st = cs.Stream(chain, 16, 1, 4, 4, 64, programs=3)
    items = [tuple(v) for v in st.plan["items"].tolist()]
    starts = st.plan["item_start"].tolist()
    assert sorted(items) == sorted((i, b) for i, (_, n) in enumerate(ops) for b in range(n // 16))
    tiles = []
    for p in range(3):
        mine = items[starts[p]:starts[p + 1]]
        assert [op for op, _ in mine] == sorted(op for op, _ in mine)
        tiles.append(sum(ops[op][0] // 128 for op, _ in mine))
    assert max(tiles) - min(tiles) <= max(k // 128 for k, _ in ops), tiles
    w8 = st.packed.view(-1, 16, 128)
    base = st.plan["meta"][:, 0].tolist()
    for i, (k, n) in enumerate(ops):
        wi = chain.weight(i).view(torch.uint8)
        for b in range(n // 16):
            for c in range(k // 128):
                assert torch.equal(w8[base[i] + b * (k // 128) + c], wi[16 * b:16 * b + 16, 128 * c:128 * c + 128])
    res = bc.check_outputs(chain, _emulate_stream(bc, st, chain), bc.chain_reference(chain))
    assert res["ok"], res
    # with CPS tiles a stage, each stage is one contiguous run of tiles (the kernel copies it as one TMA box from
    # the group's first tile), and the emulation over that plan still matches
    chain2 = bc.make_chain([(512, 256), (256, 512)], cpu, 16, seed=2)
    st2 = cs.Stream(chain2, 16, 2, 4, 4, 64, programs=3)
    tl2, ts2 = st2.plan["tiles"].tolist(), st2.plan["tile_start"].tolist()
    for p in range(3):
        mine = tl2[ts2[p]:ts2[p + 1]]
        assert len(mine) % 2 == 0 and all(mine[g + 1] == mine[g] + 1 for g in range(0, len(mine), 2)), (p, mine)
    assert bc.check_outputs(chain2, _emulate_stream(bc, st2, chain2), bc.chain_reference(chain2))["ok"]
    st.cnt.copy_(torch.tensor([n // 16 for _, n in ops], dtype=torch.int32))
    st.check(chain)
    st.cnt[2] -= 1
    with pytest.raises(RuntimeError, match="stream: counters"):
        st.check(chain)
    st.err[0] = 2
    with pytest.raises(RuntimeError, match=r"stream: 2 spin wait\(s\) timed out"):
        st.check(chain)
    # streamfree: every op reads one fixed input from the execution's own buffer (no op reads what another writes)
    free = cs.Stream(chain, 16, 1, 4, 4, 64, programs=3, dep=False)
    assert free.plan["meta"][:, 2].tolist() == [0] * len(ops) and free.act.data_ptr() != chain.act.data_ptr()
    assert min(free.y_off) >= max(k for k, _ in ops)
    ys = _emulate_stream(bc, free, chain)
    assert bc.check_fixed_input(chain, ys, free.act)["ok"]
    ys[2][:16] = (ys[2][:16].float() * 1.05).to(torch.bfloat16)
    assert not bc.check_fixed_input(chain, ys, free.act)["ok"]


def test_kernels_compile_for_sm90_with_the_protocol_orderings():
    """``--ptx``: every kernel compiles for sm_90 (ptxas accepts it) and the PTX has pdl's launch_dependents /
    first tile / wait order, persist's tile-before-spin, acquire-before-x and barrier-before-release, and the stream
    kernel's TMA copies before its first spin, its GPU-scope acquire / release, x after the spin and a barrier before
    each release, within sm_90's shared memory (``streamfree``: no spin at all). Runs in a subprocess without the
    interpreter (conftest puts this session's Triton in interpreter mode)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["BYTEBOUND_TRITON_COMPILE_ONLY"] = "1"
    r = subprocess.run([sys.executable, str(SCRIPT), "--ptx"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PTX orderings: ok" in r.stdout
    assert "persist    sm_90: REG:" in r.stdout
    assert "flaglate   sm_90: REG:" in r.stdout
    assert "stream     sm_90: REG:" in r.stdout and "streamfree sm_90: REG:" in r.stdout
