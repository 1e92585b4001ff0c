"""Adaptive speculation (``bytebound.speculative.adaptive``, issue 21) on CPU.

* The controller's decisions from given accept lengths and times (no clock): fall back when a / c stays below
  1 - margin over a full window, probe back with a doubling interval, switch back at a / c >= 1, re-time plain
  steps after ``refresh_rounds``.
* Greedy output with switching == plain greedy token for token (eager and static rounds; the real clock, whose
  decisions vary, and an injected cost model that forces fallbacks and returns).
* The NEXTN draft layer's cache stays that of the committed sequence across switches: every NEXTN query reads only
  slots written with the committed token and the target hidden of the position before it (a reference prefill
  over the final sequence), so drafts after a plain phase are as good as without one.
* The accept-length watchdog still alarms at a ~ 1 with adaptive speculation off; with it on the engine falls
  back and says so in the speculative stats, the manifest and /metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bytebound.engine.engine import Engine
from bytebound.errors import ConfigError
from bytebound.sampling import SamplingParams
from bytebound.speculative.adaptive import AdaptiveSpeculation
from test_mtp_cpu import STEPS, OracleDrafter, prompts

MAX_NEW = 40
G = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
NANO = Path(__file__).resolve().parents[1] / "models" / "ling-nano"
# Small knobs so a 40-token output sees several switches.
SMALL = dict(adaptive_window=3, adaptive_probe_every=4, adaptive_probe_max=8, adaptive_probe_rounds=2,
             adaptive_calibration=2)


class Cycling:
    """Cost model: plain steps cost 1; rounds cost ``bad`` for ``period`` observations, then 1 for ``period``, and
    so on, so that MTP stops paying and pays again several times in one request."""

    def __init__(self, period: int = 12, bad: float = 6.0):
        self.period, self.bad, self.n = period, bad, 0

    def __call__(self, kind, seconds):
        self.n += 1
        if kind == "plain":
            return 1.0
        return self.bad if (self.n // self.period) % 2 == 0 else 1.0


# ---- the controller ------------------------------------------------------------------------------------------
def feed_rounds(c: AdaptiveSpeculation, n: int, committed: int, seconds: float) -> None:
    for _ in range(n):
        assert c.wants_rounds()
        c.observe_round(committed, seconds)


def test_controller_falls_back_probes_and_returns():
    c = AdaptiveSpeculation(window=4, margin=0.05, probe_every=5, probe_max=20, probe_rounds=2, calibration=3)
    assert c.mode == "calibrate" and not c.wants_rounds()
    for _ in range(3):
        c.observe_plain(0.010)
    assert c.mode == "mtp"
    # a = 1 (nothing accepted), round = 2 steps: a / c = 0.5, but only once the window is full
    feed_rounds(c, 3, 1, 0.020)
    assert c.mode == "mtp"
    c.observe_round(1, 0.020)
    assert c.mode == "plain" and c.counts["to_plain"] == 1
    assert c.decision["speedup"] == pytest.approx(0.5) and c.decision["round_cost"] == pytest.approx(2.0)
    # plain phase of probe_every tokens, then a probe that fails: the interval doubles (5 -> 10 -> 20 -> 20)
    for interval in (5, 10, 20, 20):
        for _ in range(interval):
            assert not c.wants_rounds()
            c.observe_plain(0.010)
        assert c.mode == "probe"
        feed_rounds(c, 2, 1, 0.020)
        assert c.mode == "plain"
    assert c.counts["probes"] == 4 and c.counts["probes_failed"] == 4 and c.interval == 20
    # the workload changes: a = 3 at c = 2 (a / c = 1.5) passes the next probe; the interval resets
    for _ in range(20):
        c.observe_plain(0.010)
    feed_rounds(c, 2, 3, 0.020)
    assert c.mode == "mtp" and c.counts["to_mtp"] == 1 and c.interval == 5
    assert c.decision["speedup"] == pytest.approx(1.5)
    st = c.state()
    assert st["fell_back"] is False and st["to_plain"] == 5 and st["probes"] == 5


def test_controller_margin_and_median():
    c = AdaptiveSpeculation(window=4, margin=0.05, calibration=2)
    c.observe_plain(0.010)
    c.observe_plain(0.010)
    # a / c = 0.97: below 1 but inside the margin, MTP stays on
    feed_rounds(c, 12, 2, 0.010 * 2 / 0.97)
    assert c.mode == "mtp" and c.speedup == pytest.approx(0.97)
    # one slow round (a pause) does not move the median round time
    c.observe_round(2, 1.0)
    assert c.mode == "mtp"
    # a / c = 0.9 over a full window falls back (within the window's length, as the slow round leaves it)
    for _ in range(4):
        if c.mode != "mtp":
            break
        c.observe_round(2, 0.010 * 2 / 0.9)
    assert c.mode == "plain" and c.decision["speedup"] < 0.95


def test_controller_refreshes_plain_timing():
    c = AdaptiveSpeculation(window=2, calibration=2, refresh_rounds=6)
    c.observe_plain(0.010)
    c.observe_plain(0.010)
    feed_rounds(c, 6, 3, 0.020)
    assert c.mode == "calibrate" and c.counts["calibrations"] == 2
    # the plain step got slower (longer context): a / c = 3 / (0.020 / 0.050), MTP stays on
    c.observe_plain(0.050)
    assert c.mode == "calibrate"
    c.observe_plain(0.050)
    assert c.mode == "mtp"
    # now the plain step is cheap again: the re-timed steps reveal a / c < 1 and it falls back at once
    feed_rounds(c, 6, 1, 0.020)
    assert c.mode == "calibrate"
    for _ in range(2):
        c.observe_plain(0.005)
    assert c.mode == "plain" and "re-timed" in c.reason


def test_next_round_certain_only_when_no_verdict_could_stop_it():
    """A pipelined loop launches a round ahead only if the controller continues whatever the round in flight
    shows: checked against the controller itself, fed that round's worst observation (1 token, a huge time)."""
    import copy
    c = AdaptiveSpeculation(window=4, margin=0.05, probe_every=5, probe_max=20, probe_rounds=3, calibration=2,
                            refresh_rounds=9)
    assert not c.next_round_certain()                       # calibrating: plain steps next
    for _ in range(2):
        c.observe_plain(0.010)
    assert c.mode == "mtp"

    def agrees():
        worst = copy.deepcopy(c)
        worst.observe_round(1, 1e9)
        return c.next_round_certain() == worst.wants_rounds()
    seen = set()
    for committed, seconds in [(3, 0.020)] * 3 + [(2, 0.020), (1, 0.020), (1, 0.020), (3, 0.019), (3, 0.021)]:
        assert agrees()
        seen.add(c.next_round_certain())
        c.observe_round(committed, seconds)
        if not c.wants_rounds():
            break
    assert seen == {True, False}                             # both answers came up on the way
    # a probe: certain while more than one of its rounds is left
    p = AdaptiveSpeculation(window=2, probe_every=5, probe_rounds=3, calibration=1)
    p.observe_plain(0.01)
    p.observe_round(1, 0.05)
    p.observe_round(1, 0.05)
    assert p.mode == "plain"
    for _ in range(5):
        p.observe_plain(0.01)
    assert p.mode == "probe"
    answers = []
    while p.mode == "probe":
        answers.append(p.next_round_certain())
        p.observe_round(1, 0.05)
    assert answers == [True, True, False]


@pytest.mark.parametrize("kw", [dict(window=0), dict(probe_rounds=0), dict(margin=1.0), dict(margin=-0.1),
                                dict(probe_every=8, probe_max=4), dict(calibration=True)])
def test_controller_rejects_bad_knobs(kw):
    with pytest.raises(ConfigError, match="adaptive speculation"):
        AdaptiveSpeculation(**kw)


# ---- the engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(quant_ckpt):
    return Engine(model=str(quant_ckpt), max_model_len=256)


@pytest.fixture(scope="module")
def reference(plain):
    return {tuple(p): plain.generate(p, G)[0].token_ids for p in prompts(plain.model.cfg.vocab_size)}


def test_adaptive_needs_mtp(quant_ckpt):
    with pytest.raises(ConfigError, match="--speculative-adaptive"):
        Engine(model=str(quant_ckpt), max_model_len=64, speculative_adaptive=True)
    with pytest.raises(ConfigError, match="probe_rounds"):
        Engine(model=str(quant_ckpt), max_model_len=64, speculative_steps=STEPS, speculative_adaptive=True,
               adaptive_probe_rounds=0)


def test_adaptive_refused_with_tensor_parallelism(quant_ckpt):
    """Each rank's controller decides on its own clock and the plain steps keep the rank's own token, so the
    ranks would run different collectives: refused, by name, before any process group or weight is needed."""
    with pytest.raises(ConfigError, match="--speculative-adaptive .*--tensor-parallel-size"):
        Engine(model=str(quant_ckpt), max_model_len=64, speculative_steps=STEPS, speculative_adaptive=True,
               tensor_parallel_size=2)


def test_cli_flag_needs_nextn():
    import argparse

    from bytebound.cli import add_engine_args, engine_config
    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(ConfigError, match="--speculative-adaptive needs --speculative-algorithm NEXTN"):
        engine_config(p.parse_args(["--speculative-adaptive"]))
    cfg = engine_config(p.parse_args(["--speculative-algorithm", "NEXTN", "--speculative-adaptive",
                                      "--adaptive-window", "8", "--adaptive-probe-every", "32"]))
    assert cfg.speculative_adaptive and cfg.adaptive_window == 8 and cfg.adaptive_probe_every == 32


@pytest.mark.parametrize("static,pipe", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("forced", [False, True])
def test_adaptive_greedy_equals_plain(quant_ckpt, reference, static, pipe, forced):
    """Whatever the switching (this machine's timings, or a cost model that forces fallbacks and returns) and
    whether the plain phases are pipelined, greedy output equals plain greedy; the forced case must switch both
    ways."""
    eng = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, spec_static_round=static,
                 speculative_adaptive=True, pipeline_decode=pipe, **SMALL)
    assert eng.pipelined is pipe
    if forced:
        eng.adaptive.cost_model = Cycling()
    ahead = 0
    for p, want in reference.items():
        out = eng.generate(list(p), G)[0]
        assert out.token_ids == want, f"prompt of {len(p)} tokens diverged (static={static}, forced={forced})"
        ad = out.spec["adaptive"]
        # every token but the prefill's came from a plain step or a round; rounds commit their share
        assert 1 + ad["plain_steps"] + out.spec["committed"] == MAX_NEW
        assert ad["rounds"] == out.spec["rounds"]
        ahead += out.spec["pipelined_rounds"]
    # pipelined, rounds too are launched ahead where the next one is certain (probes, mtp phases)
    assert (ahead > 0) == pipe, ahead
    if forced:
        assert eng.adaptive.counts["to_plain"] >= 3 and eng.adaptive.counts["to_mtp"] >= 3
        assert eng.adaptive.counts["rounds"] > 0 and eng.adaptive.counts["plain_steps"] > 0


class NextnSpy:
    """Wraps ``drafter.hidden``: simulates the NEXTN cache slot by slot (what was written where, and whether it was
    the committed token with the target hidden of the position before it), and records for every draft-extend
    (a NEXTN call starting below the committed length) whether all slots below it were right."""

    def __init__(self, drafter, runner, seq: list[int], ref_hidden: torch.Tensor):
        self.real, self.runner, self.seq, self.ref = drafter.hidden, runner, seq, ref_hidden
        self.slots: dict[int, bool] = {}
        self.bad_reads: list[tuple[int, int]] = []
        self.extends = 0

    def __call__(self, ids, prev_hidden, positions, state, kv_len=None):
        pos = [int(t) for t in positions.reshape(-1)]
        if pos[0] < self.runner.pos:          # a prefix or a round's draft-extend: it reads committed slots
            self.extends += 1
            self.bad_reads += [(pos[0], t) for t in range(pos[0]) if not self.slots.get(t, False)]
        for i, t in enumerate(pos):
            ok = (t + 1 < len(self.seq) and int(ids.reshape(-1)[i]) == self.seq[t + 1]
                  and torch.allclose(prev_hidden[i].float(), self.ref[t], rtol=1e-4, atol=1e-4))
            self.slots[t] = ok
        return self.real(ids, prev_hidden, positions, state, kv_len)


@pytest.mark.parametrize("static", [False, True])
def test_nextn_cache_follows_committed_sequence(quant_ckpt, plain, reference, static, monkeypatch):
    """After plain phases the NEXTN must see every position they decoded: each draft-extend reads only slots that
    hold the committed token and (to 1e-4) the target hidden of a reference prefill over the final sequence."""
    eng = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, spec_static_round=static,
                 speculative_adaptive=True, **SMALL)
    eng.adaptive.cost_model = Cycling(period=10)
    for p, want in reference.items():
        if len(p) < 5:
            continue
        seq = list(p) + want
        plain.runner.reset()
        ref = plain.runner.prefill(torch.tensor(seq)).float()
        spy = NextnSpy(eng.drafter, eng.runner, seq, ref)
        monkeypatch.setattr(eng.drafter, "hidden", spy)
        out = eng.generate(list(p), G)[0]
        monkeypatch.undo()
        assert out.token_ids == want
        assert spy.extends > 2 and out.spec["adaptive"]["to_mtp"] >= 1
        assert not spy.bad_reads, f"prompt of {len(p)}: extends read stale NEXTN slots {spy.bad_reads[:5]}"


def test_pure_mtp_passes_the_nextn_spy(quant_ckpt, plain, reference, monkeypatch):
    """The spy itself: MTP without switching passes it, and a NEXTN that skips the plain phases' positions
    (the bug it is there to catch) fails it."""
    import bytebound.speculative.adaptive as adaptive_mod
    p = next(k for k in reference if len(k) == 17)
    seq = list(p) + reference[p]
    plain.runner.reset()
    ref = plain.runner.prefill(torch.tensor(seq)).float()
    eng = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS)
    spy = NextnSpy(eng.drafter, eng.runner, seq, ref)
    monkeypatch.setattr(eng.drafter, "hidden", spy)
    assert eng.generate(list(p), G)[0].token_ids == reference[p]
    assert spy.extends > 2 and not spy.bad_reads
    # the bug: positions decoded plainly never reach the NEXTN (a round after a plain phase is seeded with the
    # last pending position only; dropping them from the bookkeeping instead is refused by StaticRound.seed)
    ad = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, speculative_adaptive=True,
                **SMALL)
    ad.adaptive.cost_model = Cycling(period=10)
    seed = adaptive_mod.StaticRound.seed

    def seed_last_only(self, ext_ids, ext_hidden, first, y):
        if first == 0:                                    # after the prefill: as it should be
            return seed(self, ext_ids, ext_hidden, first, y)
        e = ext_ids.shape[0]
        return seed(self, ext_ids[-1:], ext_hidden[-1:], first + e - 1, y)
    monkeypatch.setattr(adaptive_mod.StaticRound, "seed", seed_last_only)
    spy = NextnSpy(ad.drafter, ad.runner, seq, ref)
    monkeypatch.setattr(ad.drafter, "hidden", spy)
    try:
        ad.generate(list(p), G)
    except Exception:        # the broken pending bookkeeping may also fail outright
        pass
    assert spy.bad_reads


def test_adaptive_sampling_reproducible_and_within_vocab(quant_ckpt):
    """Sampling with switching: seeded runs repeat; the distribution itself is the acceptance rule's
    (test_spec_sampling) and plain sampling's, switched between tokens on past information only."""
    kw = dict(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, speculative_adaptive=True, **SMALL)
    sp = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    outs = []
    for pipe in (False, False, True):    # pipelined plain phases draw the same random numbers in the same order
        eng = Engine(**kw, pipeline_decode=pipe)
        eng.adaptive.cost_model = Cycling(period=8)
        outs.append(eng.generate([5, 6, 7, 8, 9, 10, 11], sp)[0])
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids and len(outs[0].token_ids) == 30
    assert outs[0].spec["adaptive"]["to_plain"] >= 1 and outs[0].spec["adaptive"]["plain_steps"] > 0
    # pipelined rounds too (launched ahead where the next round is certain): the same switches, rounds and steps
    keys = ("rounds", "plain_steps", "to_plain", "to_mtp", "probes")
    assert [outs[2].spec["adaptive"][k] for k in keys] == [outs[0].spec["adaptive"][k] for k in keys]
    assert outs[2].spec["pipelined_rounds"] > 0 and outs[0].spec["pipelined_rounds"] == 0


# ---- the watchdog and the fallback -------------------------------------------------------------------------
def _never_right(eng, sequence):
    """Drafts that are always wrong (the oracle of test_mtp_cpu, corrupted every time): a = 1 exactly."""
    eng.drafter = OracleDrafter(eng.runner, eng.drafter, sequence, eng.model.cfg.vocab_size, p_wrong=1.0, seed=0)


def test_watchdog_alarms_without_adaptive(quant_ckpt, reference):
    p = next(k for k in reference if len(k) == 17)
    eng = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, watchdog_window=8)
    _never_right(eng, list(p) + reference[p])
    out = eng.generate(list(p), G)[0]
    assert out.token_ids == reference[p]
    assert out.spec["accept_length"] == 1.0 and out.spec["rounds"] == MAX_NEW - 1 and "adaptive" not in out.spec
    assert eng.watchdog.alarm and eng.watchdog.state()["rolling_accept_length"] == 1.0
    from bytebound.verify.manifest import build_manifest
    eng.drafter = eng.drafter.real
    man = build_manifest(eng)
    assert man["status"] == "degraded" and man["levers"]["mtp"]["adaptive"] == {"on": False}


def test_adaptive_falls_back_at_accept_length_one(quant_ckpt, reference):
    """a = 1 at a round cost of 2 plain steps (injected): the engine decodes plainly after one window and the
    stats, the manifest and /metrics say so."""
    from bytebound.server.app import Metrics
    from bytebound.verify.manifest import build_manifest, format_manifest
    from prometheus_client import generate_latest
    p = next(k for k in reference if len(k) == 17)
    eng = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, watchdog_window=16,
                 speculative_adaptive=True, adaptive_window=4, adaptive_probe_every=16, adaptive_calibration=2)
    eng.adaptive.cost_model = lambda kind, s: 2.0 if kind == "round" else 1.0
    _never_right(eng, list(p) + reference[p])
    out = eng.generate(list(p), G)[0]
    assert out.token_ids == reference[p]
    ad = out.spec["adaptive"]
    # 2 calibration steps, 4 rounds, 16 plain, a 4-round probe, then plain again
    assert ad["to_plain"] == 2 and ad["to_mtp"] == 0 and ad["probes"] == 1 and ad["mode"] == "plain"
    assert ad["rounds"] == 8 and ad["plain_steps"] == MAX_NEW - 1 - 8
    # NEXTN catch-ups between tokens: the prompt's after the calibration, the 16 plain tokens' at the probe
    assert ad["catchups"] == 2 and ad["catchup_ms"] > 0
    # each catch-up leaves the last k + 1 pending positions to the round's draft-extend; the rounds before the
    # plain phase leave their committed one (a = 1) pending
    assert eng.adaptive.counts["catchup_positions"] == (len(p) + 2 - (STEPS + 1)) + (1 + 16 - (STEPS + 1))
    assert ad["last_decision"]["speedup"] == pytest.approx(0.5)
    assert out.spec["accept_length"] == 1.0
    assert not eng.watchdog.alarm            # 8 rounds in a 16-round watchdog window: the fallback came first
    eng.drafter = eng.drafter.real
    man = build_manifest(eng)
    st = man["levers"]["mtp"]["adaptive"]
    assert st["fell_back"] and st["mode"] == "plain" and "a/c = 0.500" in st["reason"]
    assert "FELL BACK to plain decoding" in format_manifest(man)
    m = Metrics()
    m.sync_adaptive(eng.adaptive)
    m.sync_adaptive(eng.adaptive)            # counters advance by what changed, not twice
    text = generate_latest(m.registry).decode()
    assert 'bytebound_spec_adaptive_mode{mode="plain"} 1.0' in text
    assert 'bytebound_spec_adaptive_mode{mode="mtp"} 0.0' in text
    assert 'bytebound_spec_adaptive_switches_total{to="plain"} 2.0' in text
    assert f"bytebound_spec_adaptive_plain_steps_total {float(MAX_NEW - 1 - 8)}" in text
    assert "bytebound_spec_adaptive_speedup 0.5" in text


def test_catchup_warmup_covers_every_bucket_and_is_harmless(quant_ckpt, reference):
    """The start-up warm-up (CUDA only in the engine; the function runs anywhere): its lengths reach every tiling
    bucket of the grouped MoE prefill and every M specialisation (M == 1, M % 16) that a catch-up of any length
    1..PREFILL_CHUNK reaches, and the garbage it leaves in the NEXTN cache changes no token."""
    import bytebound.runner.runner as runner_mod
    from bytebound.kernels.triton_moe_grouped import prefill_config
    from bytebound.speculative.adaptive import catchup_sizes, warm_catchup

    def variants(ms, k, e):
        return {(prefill_config(m, k, e)["BM"], m == 1, m % 16 == 0) for m in ms}
    sizes = catchup_sizes(runner_mod.PREFILL_CHUNK + 1)
    assert max(sizes) == runner_mod.PREFILL_CHUNK and sizes == sorted(set(sizes))
    for k, e in ((8, 512), (8, 256), (2, 16)):       # Ling-3.0-flash, a half-size config, the tiny test model
        assert variants(range(1, runner_mod.PREFILL_CHUNK + 1), k, e) <= variants(sizes, k, e), (k, e)
    assert max(catchup_sizes(256)) == 129           # below the cache length
    eng = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, speculative_adaptive=True,
                 **SMALL)
    assert eng.catchup_warmup is None                # CPU: nothing to compile
    eng.adaptive.cost_model = Cycling()
    nextn = eng.runner.state[eng.model.cfg.num_hidden_layers]
    before = nextn.kv.clone()
    got = warm_catchup(eng.runner, eng.drafter)
    assert got["sizes"] == catchup_sizes(256) and not torch.equal(before, nextn.kv)
    for p, want in reference.items():
        assert eng.generate(list(p), G)[0].token_ids == want


# ---- the bundled model --------------------------------------------------------------------------------------
@pytest.mark.skipif(not (NANO / "model.safetensors").exists(), reason="trained ling-nano weights not present")
def test_bundled_model_gsm8k_adaptive_equals_plain():
    """The acceptance line on CPU: GSM8K prompts of the bundled model, adaptive == plain greedy, with this
    machine's timings (on CPU MTP does not pay, so it falls back) and with switching forced both ways."""
    from bytebound.data.gsm8k import load_split
    qs = [r["question"] for r in load_split("test")[:3]]
    p = SamplingParams(max_tokens=40)
    plain = Engine()
    real = Engine(speculative_steps=STEPS, speculative_adaptive=True, **SMALL)
    forced = Engine(speculative_steps=STEPS, spec_static_round=True, speculative_adaptive=True, **SMALL)
    forced.adaptive.cost_model = Cycling()
    for q in qs:
        want = plain.generate(q, p, chat=True)[0].token_ids
        assert real.generate(q, p, chat=True)[0].token_ids == want
        out = forced.generate(q, p, chat=True)[0]
        assert out.token_ids == want
    assert forced.adaptive.counts["to_plain"] >= 2 and forced.adaptive.counts["to_mtp"] >= 2
    # the trained draft still drafts well after plain phases (the NEXTN saw their positions)
    assert forced.spec_totals.accept_length > 1.5


def test_server_reports_adaptive_decision(quant_ckpt, reference):
    """Through the HTTP server: the non-streaming response carries the speculative stats with the adaptive
    decision, and /metrics its gauges and counters."""
    from fastapi.testclient import TestClient

    from bytebound.server.app import create_app
    p = next(k for k in reference if len(k) == 17)
    eng = Engine(model=str(quant_ckpt), max_model_len=256, speculative_steps=STEPS, speculative_adaptive=True,
                 adaptive_window=4, adaptive_probe_every=16, adaptive_calibration=2)
    eng.adaptive.cost_model = lambda kind, s: 5.0 if kind == "round" else 1.0     # a <= k + 1 = 4: a/c < 1
    with TestClient(create_app(eng, served_model_name="t")) as c:
        r = c.post("/v1/completions", json={"model": "t", "prompt": list(p), "max_tokens": MAX_NEW,
                                            "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == reference[p]
        ad = body["speculative"]["adaptive"]
        assert ad["to_plain"] >= 1 and ad["plain_steps"] > 0
        text = c.get("/metrics").text
    assert 'bytebound_spec_adaptive_switches_total{to="plain"} ' + f"{float(ad['to_plain'])}" in text
    assert f"bytebound_spec_adaptive_plain_steps_total {float(ad['plain_steps'])}" in text
    assert f'bytebound_spec_adaptive_mode{{mode="{ad["mode"]}"}} 1.0' in text
