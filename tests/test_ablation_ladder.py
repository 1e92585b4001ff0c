"""Issue 21: the ablation ladder re-run on the H200 - several input lengths per step, the measured MTP round cost,
the priced TPOT on synthetic weights (from an accept length measured on a trained model, never assumed), the
``record`` TPOT rule, partial reports, re-pricing, and the exit codes (CPU, fake engines and a tiny checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bytebound.bench import ablation as ab
from bytebound.cli import main
from bytebound.engine.engine import EngineConfig, RequestOutput
from bytebound.errors import BackendError, ConfigError

ROOT = Path(__file__).resolve().parents[1]
NANO_H200 = ROOT / "docs" / "perf" / "mtp-accept-nano-h200-graph-4e7a079.json"     # committed trained-model record


def _out(tpot_ms: float, n: int = 9, rounds: int = 0, committed: int = 0, round_s: float = 0.0):
    """One finished request of ``n`` tokens at ``tpot_ms``; with ``rounds`` an MTP request whose rounds took
    ``round_s`` seconds in all (SpecStats verify_s)."""
    spec = None
    if rounds:
        spec = {"rounds": rounds, "committed": committed, "accept_length": committed / rounds, "draft_s": 0.0,
                "verify_s": round_s, "rollback_s": 0.0}
    return RequestOutput("", [1] * n, "length", 4, n, 0.01, tpot_ms / 1e3, 0.01 + (n - 1) * tpot_ms / 1e3, spec)


# ---- round cost and pricing: against hand-computed values -----------------------------------------------------
def test_round_cost_from_spec_stats_and_wall():
    # 8 decode tokens at 12 ms after the first; 8 rounds whose own time was 80 ms in all (10 ms each): the 16 ms
    # the decode window holds beyond that is the NEXTN prompt pass and the loop
    o = _out(12.0, n=9, rounds=8, committed=8, round_s=0.080)
    r = ab.round_cost([o], plain_tpot_ms=5.0)
    assert r["rounds"] == 8 and r["accept_length"] == 1.0
    assert r["round_ms"] == pytest.approx(10.0) and r["round_ms_wall"] == pytest.approx(12.0)
    assert r["c"] == pytest.approx(2.0) and r["c_wall"] == pytest.approx(2.4)
    assert ab.round_cost([_out(5.0)], 5.0) is None                     # no MTP: nothing to measure
    nop = ab.round_cost([o], None)                                     # no plain step to compare with
    assert nop["c"] is None and nop["round_ms"] == pytest.approx(10.0)
    # without timed rounds (a record that has none) the wall is the round
    assert ab.round_cost([_out(12.0, rounds=8, committed=8)], 6.0)["c"] == pytest.approx(2.0)


def test_price_is_round_over_accept_length():
    rnd = {"round_ms": 10.0, "round_ms_wall": 12.0, "plain_tpot_ms": 5.0, "c": 2.0}
    p1, p2 = ab.price(rnd, [{"accept_length": 2.5, "source": "a"}, {"accept_length": 2.0, "source": "b"}])
    assert p1["priced"] and p1["source"] == "a"
    assert p1["tpot_ms"] == pytest.approx(4.0) and p1["tpot_ms_wall"] == pytest.approx(4.8)
    assert p1["speedup"] == pytest.approx(1.25) and p1["change_pct"] == pytest.approx(-20.0)    # A / c
    assert p2["speedup"] == pytest.approx(1.0) and p2["change_pct"] == pytest.approx(0.0)       # break-even
    assert ab.price(rnd, []) == []


def test_accept_lengths_come_from_trained_model_records(tmp_path):
    got = ab.accept_from_file(NANO_H200, 4)
    assert len(got) == 1 and got[0]["accept_length"] == pytest.approx(2.3864)
    assert got[0]["sampling"] == "greedy" and "trained" in got[0]["weights"]
    assert "4e7a079" in got[0]["source"] and NANO_H200.name in got[0]["source"]
    gsm = {"benchmark": "ablation", "meta": {"weights": "trained (ling-nano)", "device": "NVIDIA H200", "commit": "x"},
           "workload": {"workload": "gsm8k", "temperature": 0.6, "top_p": 0.95, "top_k": 29},
           "steps": [{"step": "+fp8-head", "summary": {}},
                     {"step": "+mtp", "summary": {"accept_length": {"aggregate": 2.1, "rounds": 900}}}]}
    f = tmp_path / "gsm.json"
    f.write_text(json.dumps(gsm))
    (a,) = ab.accept_from_file(f, 4)
    assert a["accept_length"] == 2.1 and "T 0.6" in a["sampling"] and "900 rounds" in a["source"]
    # synthetic weights accept nothing: such a record cannot price anything
    gsm["meta"]["weights"] = "synthetic (random, real shapes)"
    f.write_text(json.dumps(gsm))
    with pytest.raises(ConfigError, match="trained model"):
        ab.accept_from_file(f, 4)
    gsm["meta"]["weights"] = "trained (ling-nano)"
    gsm["steps"][1]["summary"]["accept_length"]["aggregate"] = 4.5           # more than k + 1 tokens per round
    f.write_text(json.dumps(gsm))
    with pytest.raises(ConfigError, match="outside"):
        ab.accept_from_file(f, 4)
    f.write_text(json.dumps({"benchmark": "gsm8k", "summary": {}}))     # no MTP in it
    with pytest.raises(ConfigError, match="no measured accept length"):
        ab.accept_from_file(f, 4)
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        ab.accept_from_file(f, 4)
    with pytest.raises(ConfigError, match="cannot read"):
        ab.accept_from_file(tmp_path / "missing.json", 4)


def test_explicit_accept_length_needs_a_source_and_a_sane_value():
    assert ab.check_pricing([{"accept_length": 2.4, "source": "docs/perf/x.json"}], 4)
    with pytest.raises(ConfigError, match="--price-accept-source"):
        ab.check_pricing([{"accept_length": 2.4, "source": None}], 4)
    with pytest.raises(ConfigError, match=r"\[1, 4\]"):
        ab.check_pricing([{"accept_length": 0.5, "source": "s"}], 4)
    with pytest.raises(ConfigError, match=r"\[1, 4\]"):
        ab.check_pricing([{"accept_length": float("nan"), "source": "s"}], 4)


# ---- the ladder with cases, fake engines -----------------------------------------------------------------------
def _ladder(monkeypatch, tpots, rounds_ms=None, device="cuda", load_format="dummy", base=None, **kw):
    """Run the ladder on fake engines: ``tpots[step][case]`` is the step's TPOT per case; the +mtp step's requests
    carry MTP stats with ``rounds_ms[case]`` per round and one token per round (nothing accepted)."""
    monkeypatch.setattr(ab, "check_lever", lambda step, eng, outputs=None: (True, "fake"))
    made = []

    def make(cfg):
        made.append(cfg)
        return cfg

    def work(cfg, case):
        t = tpots[len(made) - 1][case]
        if cfg.speculative_steps:
            return [_out(t, n=9, rounds=8, committed=8, round_s=8 * rounds_ms[case] / 1e3)], {"input_len": case}
        return [_out(t)], {"input_len": case}

    kw.setdefault("log", lambda *_: None)
    base = base or EngineConfig(device=device, load_format=load_format)
    r = ab.run_ablation(base, work, cases=[2048, 32768], make_engine=make, manifest=lambda eng: {}, **kw)
    return r, made


def test_draft_vocab_is_the_mtp_steps_alone(monkeypatch):
    """``--speculative-draft-vocab`` given to the ablation: only the ``+mtp`` step's engine gets the hot-vocabulary
    draft head (the engine refuses one without MTP), its lever says so, and the recorded ladder agrees."""
    tpots = [{2048: 9.7, 32768: 10.5}, {2048: 4.0, 32768: 4.4}, {2048: 3.9, 32768: 4.3}, {2048: 9.5, 32768: 10.4}]
    base = EngineConfig(device="cuda", load_format="dummy", draft_vocab="hot.json")
    r, made = _ladder(monkeypatch, tpots, {2048: 9.0, 32768: 10.0}, base=base)
    assert [(c.speculative_steps, c.draft_vocab) for c in made] == [(0, None), (0, None), (0, None), (3, "hot.json")]
    assert r["steps"][3]["lever"] == "NEXTN MTP, 3 draft steps, hot-vocabulary draft head (hot.json)"
    assert [x["config"]["draft_vocab"] for x in r["ladder"]] == [None, None, None, "hot.json"]
    r0, made0 = _ladder(monkeypatch, tpots, {2048: 9.0, 32768: 10.0})
    assert made0[3].draft_vocab is None and r0["steps"][3]["lever"] == "NEXTN MTP, 3 draft steps"


def test_synthetic_mtp_row_is_priced_and_not_stopped_on(monkeypatch):
    tpots = [{2048: 9.7, 32768: 10.5}, {2048: 4.0, 32768: 4.4}, {2048: 3.9, 32768: 4.3}, {2048: 9.5, 32768: 10.4}]
    pricing = [{"accept_length": 2.386, "source": "nano H200 greedy"}]
    r, made = _ladder(monkeypatch, tpots, {2048: 9.36, 32768: 10.32}, pricing=pricing)
    assert r["status"] == "complete" and r["stop"] is None and r["synthetic_weights"]
    assert [s["step"] for s in r["steps"]] == ["baseline", "+kernel", "+fp8-head", "+mtp"]
    assert [(c.backends["moe"], c.lm_head, c.speculative_steps, c.speculative_adaptive) for c in made] == \
        [("torch", "fp32", 0, False), ("triton", "fp32", 0, False), ("triton", "fp8", 0, False),
         ("triton", "fp8", 3, False)]
    mtp = r["steps"][3]
    assert [c["case"] for c in mtp["cases"]] == ["2048", "32768"]
    c2k, c32k = mtp["cases"]
    # measured: round 9.36 ms against the +fp8-head step's 3.9 ms at 2K
    assert c2k["round"]["plain_tpot_ms"] == pytest.approx(3.9) and c2k["round"]["c"] == pytest.approx(2.4)
    assert c32k["round"]["c"] == pytest.approx(10.32 / 4.3)
    # priced: round / A, A / c; the measured +143 % rise is recorded, not a stop
    (p,) = c2k["priced"]
    assert p["tpot_ms"] == pytest.approx(9.36 / 2.386) and p["speedup"] == pytest.approx(2.386 / 2.4)
    assert p["source"] == "nano H200 greedy"
    assert c2k["change_pct"] > 100 and "recorded, not enforced" in c2k["note"] and "priced" in c2k["note"]
    assert r["regressions"] == []               # the synthetic +mtp row is not a regression
    # the first case's figures are the step's top level (one-case readers)
    assert mtp["tpot_ms"] == c2k["tpot_ms"] and mtp["change_pct"] == c2k["change_pct"]
    # each case is compared with the same case of the step before
    assert r["steps"][1]["cases"][1]["change_pct"] == pytest.approx(100 * (4.4 - 10.5) / 10.5)
    assert r["steps"][2]["cases"][0]["change_vs_baseline_pct"] == pytest.approx(100 * (3.9 - 9.7) / 9.7)


def test_cpu_rise_is_recorded_and_the_console_says_why(monkeypatch):
    """On a CPU device the default ``--tpot-rule enforce`` is set aside (``bench --help``: a rise exits 3): the
    console says so where the rule is decided, and again at each rise, which goes into the row's note."""
    said = []
    tpots = [{2048: 4.0, 32768: 4.4}, {2048: 10.2, 32768: 11.0}, {2048: 12.0, 32768: 13.0}]
    r, made = _ladder(monkeypatch, tpots, {2048: 12.0, 32768: 13.0}, device="cpu", load_format="auto",
                      log=said.append)
    assert r["status"] == "complete" and r["tpot_rule"] == "recorded, not enforced (CPU)"
    assert [s["step"] for s in r["steps"]] == ["baseline", "+kernel", "+fp8-head", "+mtp"] and len(made) == 3
    head = [ln for ln in said if ln.startswith("[ablation] CPU device:")]
    assert len(head) == 1 and "recorded, not enforced" in head[0] and "per-op overhead" in head[0]
    assert said.index(head[0]) < min(i for i, ln in enumerate(said) if "step baseline" in ln)
    rises = [ln for ln in said if "vs previous (tolerance 1.0%): recorded, not enforced (CPU device" in ln]
    assert [ln.split(":")[0] for ln in rises] == ["[ablation] +fp8-head [2048]", "[ablation] +fp8-head [32768]",
                                                  "[ablation] +mtp [2048]", "[ablation] +mtp [32768]"], said
    assert "+155.00%" in rises[0]
    said.clear()
    _ladder(monkeypatch, tpots, {2048: 12.0, 32768: 13.0}, device="cpu", load_format="auto", log=said.append,
            tpot_rule="record")
    assert not [ln for ln in said if ln.startswith("[ablation] CPU device:")]    # the user asked for it


def test_without_an_accept_length_nothing_is_priced(monkeypatch):
    tpots = [{2048: 9.7, 32768: 10.5}, {2048: 4.0, 32768: 4.4}, {2048: 3.9, 32768: 4.3}, {2048: 9.5, 32768: 10.4}]
    r, _ = _ladder(monkeypatch, tpots, {2048: 9.36, 32768: 10.32})
    c = r["steps"][3]["cases"][0]
    assert c["priced"] == [] and "not priced" in c["note"] and c["round"]["c"] == pytest.approx(2.4)
    assert r["status"] == "complete"


def test_trained_weights_mtp_rise_is_enforced_and_names_the_case(monkeypatch):
    """With real weights the accept length is measured, so a slower +mtp is a real regression (stop); a rise at
    one case (32K) is enough and the message names it."""
    tpots = [{2048: 9.7, 32768: 10.5}, {2048: 4.0, 32768: 4.4}, {2048: 3.9, 32768: 4.3}, {2048: 3.0, 32768: 4.5}]
    r, _ = _ladder(monkeypatch, tpots, {2048: 6.0, 32768: 9.0}, load_format="auto",
                   pricing=[{"accept_length": 2.4, "source": "s"}])
    assert r["status"] == "stopped" and r["stop"]["step"] == "+mtp" and r["stop"]["case"] == "32768"
    assert "at 32768" in r["stop"]["message"] and "4.300 -> 4.500 ms" in r["stop"]["message"]
    assert "priced" not in r["steps"][3]["cases"][0]            # measured accept length: nothing priced
    assert r["steps"][3]["cases"][0]["round"]["c"] == pytest.approx(6.0 / 3.9)


def test_record_rule_lists_regressions_and_goes_on(monkeypatch):
    tpots = [{2048: 9.7, 32768: 10.5}, {2048: 4.0, 32768: 4.4}, {2048: 4.2, 32768: 4.3}, {2048: 9.5, 32768: 10.4}]
    r, _ = _ladder(monkeypatch, tpots, {2048: 9.36, 32768: 10.32}, tpot_rule="record")
    assert r["status"] == "complete" and len(r["steps"]) == 4
    assert r["regressions"] == [{"step": "+fp8-head", "case": "2048", "change_pct": pytest.approx(5.0),
                                 "change_ms": pytest.approx(0.2)}]
    assert "recorded, not enforced (--tpot-rule record)" in r["steps"][2]["cases"][0]["note"]
    assert r["tpot_rule"].startswith("recorded")
    # the same ladder under the default rule stops at that step, with the case
    r, _ = _ladder(monkeypatch, tpots, {2048: 9.36, 32768: 10.32})
    assert r["status"] == "stopped" and r["stop"]["step"] == "+fp8-head" and r["stop"]["case"] == "2048"
    with pytest.raises(ValueError, match="tpot_rule"):
        _ladder(monkeypatch, tpots, {}, tpot_rule="sometimes")


def test_partial_reports_after_every_step_and_a_failing_case(monkeypatch):
    """on_step sees the ladder after every step; a case that raises stops the ladder at that step with the case
    named, and the cases measured before it stay in the record."""
    monkeypatch.setattr(ab, "check_lever", lambda step, eng, outputs=None: (True, "fake"))
    seen = []

    def work(cfg, case):
        if cfg.lm_head == "fp8" and case == 32768:
            raise RuntimeError("CUDA out of memory")
        return [_out(5.0)], {}

    r = ab.run_ablation(EngineConfig(device="cuda"), work, cases=[2048, 32768], make_engine=lambda c: c,
                        log=lambda *_: None, manifest=lambda eng: {}, tolerance=1.0,
                        on_step=lambda res: seen.append((res["status"], len(res["steps"]))))
    assert seen == [("running", 1), ("running", 2), ("running", 3)]
    assert r["status"] == "stopped" and r["stop"]["reason"] == "step failed"
    assert "case 32768" in r["stop"]["message"] and "out of memory" in r["stop"]["message"]
    st = r["steps"][2]
    assert st["active"] is False and [c["case"] for c in st["cases"]] == ["2048"]


def test_allow_fallback_keeps_going_past_a_failing_case(monkeypatch):
    """--allow-fallback: a case that fails (out of memory at 32K on the baseline) is a failed row; the other case
    and the later steps still run and are compared; a step where every case fails still stops the ladder."""
    monkeypatch.setattr(ab, "check_lever", lambda step, eng, outputs=None: (True, "fake"))

    def work(cfg, case):
        if cfg.lm_head == "fp32" and cfg.backends["moe"] == "torch" and case == 32768:
            raise RuntimeError("CUDA out of memory")
        return [_out(8.0 if cfg.backends["moe"] == "torch" else 4.0)], {}

    kw = dict(cases=[2048, 32768], make_engine=lambda c: c, log=lambda *_: None, manifest=lambda eng: {})
    r = ab.run_ablation(EngineConfig(device="cuda"), work, allow_fallback=True, **kw)
    assert r["status"] == "complete" and len(r["steps"]) == 4
    b = r["steps"][0]
    assert b["active"] and [c["case"] for c in b["cases"]] == ["2048", "32768"]
    assert "out of memory" in b["cases"][1]["error"] and b["cases"][1]["tpot_ms"] is None
    assert b["tpot_ms"] == 8.0                                   # the top level is the case that ran
    k = r["steps"][1]["cases"]
    assert k[0]["change_pct"] == pytest.approx(-50.0) and "change_pct" not in k[1]    # nothing to compare 32K with
    r = ab.run_ablation(EngineConfig(device="cuda"), lambda cfg, case: 1 / 0, allow_fallback=True, **kw)
    assert r["status"] == "stopped" and r["stop"]["reason"] == "step failed" and r["stop"]["step"] == "baseline"


def test_allow_fallback_records_a_baseline_that_cannot_start(monkeypatch):
    """A baseline whose backend cannot run here (humming's repack out of an 80 GB card's memory): without
    --allow-fallback the ladder raises, as before; with it the baseline is a failed row and the later steps run,
    each compared with the previous step that ran and none with a baseline. A ValueError (a bad configuration, not
    a backend) still raises. The report's status line names the inactive step."""
    from bytebound.bench.cli import ablation_markdown
    monkeypatch.setattr(ab, "check_lever", lambda step, eng, outputs=None: (True, "fake"))

    def make(cfg):
        if cfg.backends["moe"] == "humming":
            raise BackendError("moe[humming]: out of GPU memory repacking a layer's experts")
        return cfg

    def work(cfg, case):
        return [_out(4.0 if cfg.lm_head == "fp32" else 3.0)], {}

    kw = dict(baseline_moe="humming", cases=[2048], log=lambda *_: None, manifest=lambda eng: {})
    with pytest.raises(BackendError, match="out of GPU memory"):
        ab.run_ablation(EngineConfig(device="cuda"), work, make_engine=make, **kw)
    r = ab.run_ablation(EngineConfig(device="cuda"), work, make_engine=make, allow_fallback=True, tpot_rule="record",
                        **kw)
    assert r["status"] == "complete" and [s["step"] for s in r["steps"]] == ["baseline", "+kernel", "+fp8-head", "+mtp"]
    b, k, f = r["steps"][:3]
    assert b["active"] is False and "out of GPU memory" in b["check"] and not b.get("cases")
    assert k["active"] and k["cases"][0]["tpot_ms"] == 4.0 and "change_pct" not in k["cases"][0]
    assert f["cases"][0]["change_pct"] == pytest.approx(-25.0)               # vs +kernel, the previous that ran
    assert all("change_vs_baseline_pct" not in c for s in r["steps"] for c in s.get("cases", []))
    md = "\n".join(ablation_markdown(r, {}, {"workload": "synthetic"}))
    assert "not every lever active: `baseline`" in md
    with pytest.raises(ValueError, match="bad"):
        ab.run_ablation(EngineConfig(device="cuda"), work, allow_fallback=True,
                        make_engine=lambda c: (_ for _ in ()).throw(ValueError("bad config")), **kw)


def test_reprice_adds_rows_from_stored_rounds(monkeypatch):
    tpots = [{2048: 9.7, 32768: 10.5}, {2048: 4.0, 32768: 4.4}, {2048: 3.9, 32768: 4.3}, {2048: 9.5, 32768: 10.4}]
    r, _ = _ladder(monkeypatch, tpots, {2048: 9.36, 32768: 10.32})
    data = json.loads(json.dumps({"benchmark": "ablation", **r}))            # through JSON, as on disk
    out = ab.reprice(data, [{"accept_length": 2.0, "source": "fresh"}])
    c = out["steps"][3]["cases"][0]
    assert [p["source"] for p in c["priced"]] == ["fresh"] and "not priced" not in c["note"]
    assert c["priced"][0]["speedup"] == pytest.approx(2.0 / 2.4)
    out = ab.reprice(out, [{"accept_length": 2.5, "source": "fresh"}, {"accept_length": 2.2, "source": "other"}])
    assert [(p["source"], p["accept_length"]) for p in out["steps"][3]["cases"][0]["priced"]] == \
        [("fresh", 2.5), ("other", 2.2)]                                     # same source: replaced
    with pytest.raises(ConfigError, match="not a synthetic"):
        ab.reprice({**data, "synthetic_weights": False}, [{"accept_length": 2.0, "source": "s"}])
    with pytest.raises(ConfigError, match="bench ablation"):
        ab.reprice({"benchmark": "gsm8k"}, [])


# ---- the command line on a tiny checkpoint (CPU) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tiny_random_ckpt):
    return tiny_random_ckpt


def test_cli_ladder_two_lengths_priced_then_repriced(ckpt, tmp_path, capsys):
    """Dummy (synthetic) weights, two prompt lengths on each step's engine, priced at the committed H200 record;
    then --reprice adds an explicit accept length without an engine."""
    rc = main(["bench", "ablation", "--model", str(ckpt), "--load-format", "dummy", "--input-len", "16,24",
               "--output-len", "5", "--warmup", "0", "--no-progress", "--out", str(tmp_path), "--name", "lad",
               "--price-accept-from", str(NANO_H200)])
    assert rc == 0                                          # CPU: complete as far as a CPU can show
    data = json.loads((tmp_path / "lad.json").read_text())
    assert data["status"] == "complete" and data["synthetic_weights"] and data["cases"] == ["16", "24"]
    assert data["workload"]["input_len"] == [16, 24] and data["workload"]["max_model_len"] >= 24 + 5 + 4
    mtp = next(s for s in data["steps"] if s["step"] == "+mtp")
    assert [c["case"] for c in mtp["cases"]] == ["16", "24"]
    for c in mtp["cases"]:
        assert c["round"]["rounds"] > 0 and c["round"]["c"] > 0
        (p,) = c["priced"]
        assert p["accept_length"] == pytest.approx(2.3864)
        assert p["tpot_ms"] == pytest.approx(c["round"]["round_ms"] / 2.3864)
    md = (tmp_path / "lad.md").read_text()
    assert "PRICED, not measured" in md and "| 16 in / 5 out |" in md and "4e7a079" in md
    assert (tmp_path / "lad_ladder.png").read_bytes()[:4] == b"\x89PNG"
    rc = main(["bench", "ablation", "--reprice", str(tmp_path / "lad.json"), "--price-accept-length", "2.2",
               "--price-accept-source", "CPU test input"])
    assert rc == 0
    data = json.loads((tmp_path / "lad.json").read_text())
    mtp = next(s for s in data["steps"] if s["step"] == "+mtp")
    assert [p["accept_length"] for p in mtp["cases"][0]["priced"]] == [pytest.approx(2.3864), 2.2]
    assert "CPU test input" in (tmp_path / "lad.md").read_text()


@pytest.mark.parametrize("args, flag", [
    (["--price-accept-length", "2.2"], "--price-accept-source"),
    (["--price-accept-length", "9"], "--price-accept-length"),
    (["--price-accept-source", "x"], "--price-accept-source without"),
    (["--price-accept-from", "/nonexistent.json"], "--price-accept-from"),
    (["--input-len", "16,0"], "--input-len"),
    (["--tpot-tolerance", "-1"], "--tpot-tolerance"),
])
def test_bad_ladder_arguments_exit_2_before_the_engine(ckpt, tmp_path, capsys, args, flag):
    rc = main(["bench", "ablation", "--model", str(ckpt), "--out", str(tmp_path), "--no-progress"] + args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("[bench] error: ConfigError") and flag in err[0]
    assert not list(tmp_path.glob("*.json"))


def test_reprice_without_inputs_or_of_a_non_ablation_file_exits_2(tmp_path, capsys):
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"benchmark": "gsm8k"}))
    assert main(["bench", "ablation", "--reprice", str(f)]) == 2
    assert "needs --price-accept-from" in capsys.readouterr().err
    assert main(["bench", "ablation", "--reprice", str(f), "--price-accept-from", str(NANO_H200)]) == 2
    assert "bench ablation JSON" in capsys.readouterr().err


def test_exit_codes(ckpt, tmp_path, monkeypatch):
    """0 complete (also with regressions under --tpot-rule record), 3 stopped; the report is written either way."""
    base = {"stop": None, "steps": [], "cases": [], "device": "cuda", "tpot_rule": "enforced", "regressions": [],
            "synthetic_weights": False, "pricing": [], "ladder": [], "tolerance": 0.01, "allow_fallback": False}
    for status, stop, regressions, want in [("complete", None, [], 0), ("stopped", {"step": "+kernel", "message": "m"},
                                                                         [], 3),
                                            ("complete", None, [{"step": "+fp8-head", "case": None,
                                                                 "change_pct": 2.0, "change_ms": 0.1}], 0)]:
        monkeypatch.setattr(ab, "run_ablation", lambda *a, **k: {**base, "status": status, "stop": stop,
                                                                  "regressions": regressions})
        name = f"x{want}{len(regressions)}"
        rc = main(["bench", "ablation", "--model", str(ckpt), "--out", str(tmp_path), "--name", name,
                   "--input-len", "16", "--output-len", "4", "--no-progress"])
        assert rc == want
        md = (tmp_path / f"{name}.md").read_text()
        assert ("Stopped at step `+kernel`" in md) == (want == 3)
        assert ("made TPOT worse: `+fp8-head`" in md) == bool(regressions)


def test_max_model_len_is_raised_to_the_longest_length():
    """The full-scale 32K case: --max-model-len (default 4096) is raised to what the longest request needs."""
    import argparse
    from bytebound.bench import cli as bc
    from bytebound.config import LING3_FLASH_CONFIG
    p = argparse.ArgumentParser()
    bc.add_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["bench", "ablation", "--model", str(LING3_FLASH_CONFIG), "--load-format", "dummy",
                      "--device", "cuda", "--input-len", "2048,32768", "--output-len", "256"])
    assert a.input_len == (2048, 32768)
    cfg = bc._config(a, synthetic=True)
    assert cfg.max_model_len == 32768 + 256 + 3 + 1 and cfg.load_format == "dummy"
