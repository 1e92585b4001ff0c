"""Issue 9: ``bytebound bench`` (gsm8k, synthetic, ablation) on a random-weight tiny checkpoint, on CPU."""

from __future__ import annotations

import json

import pytest

from bytebound.bench import ablation as ab
from bytebound.cli import main
from bytebound.engine.engine import Engine, EngineConfig, RequestOutput

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def ckpt(tiny_random_ckpt):
    return tiny_random_ckpt


def _files(out, name):
    data = json.loads((out / f"{name}.json").read_text())
    md = (out / f"{name}.md").read_text()
    pngs = sorted(out.glob(f"{name}_*.png"))
    assert pngs and all(p.read_bytes()[:8] == PNG for p in pngs)
    assert data["files"]["png"] == [p.name for p in pngs]
    return data, md


def _check_meta(meta, weights):
    for k in ("date", "commit", "device", "weights", "manifest", "command"):
        assert meta.get(k), k
    assert meta["weights"] == weights
    assert meta["manifest"].get("levers") or meta["manifest"].get("resolutions")


def _check_summary(s):
    for k in ("tpot_ms", "ttft_ms", "e2e_ms"):
        assert {"mean", "p50", "p95"} <= set(s[k]) and s[k]["mean"] > 0
    assert s["decode_tok_s"]["aggregate"] > 0
    assert s["output_len"]["histogram"]["counts"] and s["output_len"]["total"] > 0


def test_gsm8k_bench_writes_report(ckpt, tmp_path):
    rc = main(["bench", "gsm8k", "--model", str(ckpt), "--limit", "3", "--max-tokens", "8", "--out", str(tmp_path),
               "--no-progress", "--weights-label", "synthetic (random, real shapes)"])
    assert rc == 0
    data, md = _files(tmp_path, "gsm8k")
    _check_meta(data["meta"], "synthetic (random, real shapes)")
    _check_summary(data["summary"])
    assert data["n"] == 3 and 0 <= data["accuracy"] <= 1 and len(data["ci95"]) == 2
    assert data["sampling"] == {"shots": 5, "seed": 0, "max_tokens": 8, "temperature": 0.6, "top_p": 0.95,
                                "top_k": 29, "stop": ["\n\n", "Question:"]}
    q = data["questions"]
    assert [r["idx"] for r in q] == [0, 1, 2] and all({"gold", "pred", "correct", "text"} <= set(r) for r in q)
    assert q[0]["gold"] == "18"                              # GSM8K test[0]: Janet's ducks
    assert all(r["completion_tokens"] <= 8 for r in q)
    for s in ("Accuracy", "TPOT", "TTFT", data["meta"]["commit"], "manifest", "gsm8k_latency.png"):
        assert s in md, s


def test_gsm8k_bench_with_mtp_reports_accept_length(ckpt, tmp_path):
    rc = main(["bench", "gsm8k", "--model", str(ckpt), "--limit", "2", "--max-tokens", "6", "--out", str(tmp_path),
               "--no-progress", "--speculative-algorithm", "NEXTN", "--name", "mtp"])
    assert rc == 0
    data, md = _files(tmp_path, "mtp")
    acc = data["summary"]["accept_length"]
    assert acc["rounds"] > 0 and 1.0 <= acc["aggregate"] <= 4.0
    assert "Accept length" in md
    assert data["meta"]["weights"].startswith("checkpoint ")      # a tmp checkpoint is not called trained


def test_synthetic_bench(ckpt, tmp_path):
    rc = main(["bench", "synthetic", "--model", str(ckpt), "--input-len", "48", "--output-len", "12",
               "--out", str(tmp_path), "--no-progress", "--weights-label", "synthetic (random, real shapes)"])
    assert rc == 0
    data, md = _files(tmp_path, "synthetic")
    _check_summary(data["summary"])
    r = data["requests"][0]
    assert r["prompt_tokens"] == 48 and r["completion_tokens"] == 12          # EOS ignored: exact length
    f = data["byte_floor"]
    assert f["step_bytes"] > 0 and "CPU" in f["bandwidth_note"]
    assert f["tpot_over_floor"] is None or f["tpot_over_floor"] > 0
    assert "Byte floor" in md and "CPU run" in md


# ---- ablation ------------------------------------------------------------------------------------------------
ABL = ["bench", "ablation", "--input-len", "24", "--output-len", "6", "--warmup", "0", "--no-progress"]


def test_ablation_allow_fallback_on_cpu_skips_kernel_and_continues(ckpt, tmp_path):
    """On CPU the CUDA-only +kernel step is a skipped row (also with --allow-fallback) and the ladder goes on;
    stopping at an inactive lever is a CUDA rule (test_ablation_inactive_lever_stays_off_for_later_steps)."""
    rc = main(ABL + ["--model", str(ckpt), "--out", str(tmp_path), "--allow-fallback"])
    data, md = _files(tmp_path, "ablation")
    steps = {s["step"]: s for s in data["steps"]}
    k = steps["+kernel"]
    assert k["active"] is False and k["skipped"] and "needs a CUDA device" in k["check"] and "tpot_ms" not in k
    assert rc == 0 and data["status"] == "complete"              # CPU: TPOT changes recorded, not enforced
    assert steps["+mtp"]["active"] and "accept_length" in steps["+mtp"]["summary"]
    assert steps["+fp8-head"]["active"] and steps["+fp8-head"]["tpot_ms"] > 0
    _check_meta(data["meta"], data["meta"]["weights"])


def _fake_outputs(tpot_ms):
    return [RequestOutput("", [1] * 5, "length", 4, 5, 0.01, tpot_ms / 1e3, 0.05)]


def test_ablation_tpot_rule(monkeypatch):
    """Each step is compared with the previous one; a rise beyond the tolerance stops the ladder by name."""
    monkeypatch.setattr(ab, "check_lever", lambda step, eng, outputs=None: (True, "fake"))
    made = []

    def make(cfg):
        made.append(cfg)
        return object()

    def run(tpots, tol=0.01, device="cuda"):           # the speed rule is enforced on CUDA
        it = iter(tpots)
        made.clear()
        return ab.run_ablation(EngineConfig(device=device), lambda eng: (_fake_outputs(next(it)), {}),
                               tolerance=tol, make_engine=make, log=lambda *_: None, manifest=lambda eng: {})

    r = run([10.0, 8.0, 9.0, 5.0])
    assert r["status"] == "stopped" and r["stop"]["step"] == "+fp8-head" and r["stop"]["reason"] == "TPOT worse"
    assert "+12.50%" in r["stop"]["message"] and "8.000 -> 9.000 ms" in r["stop"]["message"]
    assert len(r["steps"]) == 3
    # the configs change one lever at a time
    assert [(c.backends["moe"], c.lm_head, c.speculative_steps) for c in made] == \
        [("torch", "fp32", 0), ("triton", "fp32", 0), ("triton", "fp8", 0)]
    r = run([10.0, 8.0, 7.0, 3.0])
    assert r["status"] == "complete" and r["stop"] is None
    assert [round(s["change_pct"], 1) for s in r["steps"][1:]] == [-20.0, -12.5, -57.1]
    assert round(r["steps"][-1]["change_vs_baseline_pct"], 1) == -70.0
    assert run([10.0, 10.05, 9.0, 8.0])["status"] == "complete"           # +0.5 % is inside the 1 % tolerance
    # on CPU the kernel step is skipped with its reason and a TPOT rise is recorded, not enforced
    r = run([10.0, 12.0, 15.0], device="cpu")
    assert r["status"] == "complete" and r["tpot_rule"].startswith("recorded")
    assert [s["step"] for s in r["steps"]] == ["baseline", "+kernel", "+fp8-head", "+mtp"]
    assert r["steps"][1]["skipped"] and "needs a CUDA device" in r["steps"][1]["check"]
    assert [(c.backends["moe"], c.lm_head, c.speculative_steps) for c in made] == \
        [("torch", "fp32", 0), ("torch", "fp8", 0), ("torch", "fp8", 3)]
    assert "+20.00%: recorded, not enforced on CPU" in r["steps"][2]["note"]


def test_check_lever_on_real_engines(ckpt):
    e = Engine(model=str(ckpt), lm_head="fp8")
    assert ab.check_lever("+fp8-head", e)[0]
    assert not ab.check_lever("baseline", e)[0]                         # fp8 head is not the baseline
    e = Engine(model=str(ckpt), lm_head="fp32", backends={"moe": "torch"})
    assert ab.check_lever("baseline", e)[0] and not ab.check_lever("+fp8-head", e)[0]
    e = Engine(model=str(ckpt), speculative_steps=3)
    outs = e.generate([5, 6, 7, 8], __import__("bytebound.sampling", fromlist=["x"]).SamplingParams(max_tokens=6))
    assert ab.check_lever("+mtp", e, outs)[0]
    assert not ab.check_lever("+mtp", Engine(model=str(ckpt)))[0]
    e = Engine(model=str(ckpt), speculative_steps=3, draft_share="weight-only", lm_head="fp8")
    ok, why = ab.check_lever("+mtp", e, outs)
    assert not ok and "LM-head module" in why


def test_ablation_inactive_lever_stays_off_for_later_steps(monkeypatch):
    """A lever the engine cannot start with is run off (with --allow-fallback) and stays off afterwards, so a later
    step is not blamed for it; without the flag the ladder stops at that step."""
    from bytebound.errors import BackendError
    monkeypatch.setattr(ab, "check_lever", lambda step, eng, outputs=None: (True, "fake"))
    made = []

    def make(cfg):
        if cfg.backends["moe"] == "triton":
            raise BackendError("moe[triton] unusable here")
        made.append(cfg)
        return object()

    kw = dict(make_engine=make, log=lambda *_: None, manifest=lambda eng: {}, tolerance=10.0)
    cuda = EngineConfig(device="cuda")          # on a CPU device the CUDA-only kernel step is skipped before start
    r = ab.run_ablation(cuda, lambda eng: (_fake_outputs(5.0), {}), allow_fallback=True, **kw)
    assert r["status"] == "complete"
    assert [s["active"] for s in r["steps"]] == [True, False, True, True]
    assert "moe[triton] unusable" in r["steps"][1]["check"]
    assert [(c.backends["moe"], c.lm_head, c.speculative_steps) for c in made] == \
        [("torch", "fp32", 0), ("torch", "fp32", 0), ("torch", "fp8", 0), ("torch", "fp8", 3)]
    made.clear()
    r = ab.run_ablation(cuda, lambda eng: (_fake_outputs(5.0), {}), allow_fallback=False, **kw)
    assert r["status"] == "stopped" and r["stop"]["step"] == "+kernel" and len(made) == 1


# ---- bad arguments: rejected before the engine loads, nothing written outside --out ------------------------------
@pytest.mark.parametrize("cmd, args, flag", [
    ("synthetic", ["--bandwidth", "abc"], "--bandwidth"),
    ("synthetic", ["--bandwidth", "-1"], "--bandwidth"),
    ("synthetic", ["--bandwidth", "0"], "--bandwidth"),
    ("synthetic", ["--bandwidth", "nan"], "--bandwidth"),
    ("synthetic", ["--name", "../escaped"], "--name"),
    ("synthetic", ["--name", "a/b"], "--name"),
    ("synthetic", ["--name", ""], "--name"),
    ("synthetic", ["--watchdog-window", "0"], "--watchdog-window"),
    ("synthetic", ["--watchdog-threshold", "nan"], "--watchdog-threshold"),
    ("gsm8k", ["--shots", "99"], "--shots"),
    ("ablation", ["--tpot-tolerance", "-1"], "--tpot-tolerance"),
    ("ablation", ["--tpot-tolerance", "nan"], "--tpot-tolerance"),
])
def test_bad_arguments_rejected_before_the_engine(ckpt, tmp_path, monkeypatch, capsys, cmd, args, flag):
    from bytebound.bench import cli as bench_cli

    def no_engine(cfg):
        raise AssertionError("the engine was started before the arguments were checked")
    monkeypatch.setattr(bench_cli, "_start", no_engine)
    out = tmp_path / "out"
    rc = main(["bench", cmd, "--model", str(ckpt), "--out", str(out), "--no-progress", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "ConfigError" in err and flag in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["out"])       # nothing escaped --out
    assert not out.exists() or not any(out.iterdir())


def _prompt_lengths(ckpt, n, shots):
    from bytebound.bench.gsm8k import gsm8k_requests
    eng = Engine(model=str(ckpt))
    return [len(eng.encode_prompt(r["prompt"])) for r in gsm8k_requests(n, shots)]


def test_gsm8k_every_question_skipped_is_an_error(ckpt, tmp_path, capsys):
    rc = main(["bench", "gsm8k", "--model", str(ckpt), "--limit", "1", "--max-tokens", "2", "--max-model-len", "64",
               "--out", str(tmp_path), "--no-progress", "--no-canaries"])
    err = capsys.readouterr().err
    assert rc == 2 and "RequestError" in err and "skipped" in err and "max_model_len" in err


def test_gsm8k_skipped_questions_are_not_in_the_accuracy(ckpt, tmp_path, capsys):
    lens = _prompt_lengths(ckpt, 2, 0)
    assert lens[0] > lens[1] + 1, lens                     # zero-shot GSM8K test[0] is longer than test[1]
    # room for test[1] and one output token (max_len - 1 - prompt >= 1), not for test[0]
    rc = main(["bench", "gsm8k", "--model", str(ckpt), "--limit", "2", "--shots", "0", "--max-tokens", "2",
               "--max-model-len", str(lens[1] + 2), "--out", str(tmp_path), "--no-progress", "--no-canaries"])
    out = capsys.readouterr().out
    assert rc == 0
    data, md = _files(tmp_path, "gsm8k")
    assert data["n"] == 1 and data["skipped"] == 1 and data["accuracy"] == data["correct"]
    assert data["questions"][0]["skipped"] and not data["questions"][1].get("skipped")
    assert f"accuracy {data['correct']}/1 " in out and "1 skipped: prompt does not fit max_model_len" in out
    assert f"(0-shot prompts of {lens[1]} tokens on average)" in out     # the skipped question's prompt not in it
    assert f"**{data['correct']}/1 = " in md and "1 skipped: prompt does not fit max_model_len" in md
