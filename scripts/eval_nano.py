"""Measure ling-nano on the GSM8K **test** split, on the exported (quantised) checkpoint.

    python scripts/eval_nano.py --ckpt models/ling-nano --out docs/perf/ling-nano-eval.json            # CPU
    python scripts/eval_nano.py --ckpt CKPT --float-weights nano_float.pt --device cuda --greedy-n 0   # GPU

Figures (all on the checkpoint as ``bytebound.checkpoint.loader.load_model`` loads it, torch backends):

* ``teacher_forced.chat``: each test question + reference solution in the chat format
  (``<role>HUMAN</role>q<|role_end|><role>ASSISTANT</role>solution<|role_end|>``): perplexity of the answer tokens
  (solution + ``<|role_end|>``), next-token top-1 accuracy, and the NEXTN head's top-1 accuracy on token t+2
  (NEXTN input: final-normed hidden at t and embedding of token t+1, at position t) over all positions of the
  held-out text and over answer positions only. ``nextn_agree_target_top1`` is how often the NEXTN top-1 equals
  the target model's own top-1 at t+1, i.e. the greedy acceptance rate of the first draft.
* ``teacher_forced.five_shot``: the same on ``few_shot_prompt(question) + " " + solution`` (the benchmark
  layout), answer tokens only.
* ``implied_accept_length``: for 3 chain drafts with a per-draft acceptance p, assuming independent steps,
  E[tokens per verify] = 1 + p + p^2 + p^3 (the bonus token plus the accepted prefix).
* ``quant_vs_float`` (with ``--float-weights``): KL(P_float || P_quant) in nats per token and top-1 agreement,
  same held-out text, all positions, for the main head and the NEXTN head.
* ``quant_ablation`` (with ``--float-weights`` and ``--quant-ablation N``): which quantisation moves the argmax.
  Hybrids of the float model, each taking one class of weights from the checkpoint, dequantised:
  ``fp8_linears_only`` (every FP8 block linear), ``mxfp4_experts_only`` (every routed expert) and
  ``bf16_storage_only`` (every other tensor as the checkpoint stores it), against the float model on the first N
  chat test records: KL and top-1 agreement as above. ``all_from_checkpoint`` (all three) must reproduce
  ``checkpoint``, the quantised model itself against the float model on the same N records: a check that the
  hybrids are built right.
* ``act_quant_ablation`` (``--act-quant N``): the question a W4A8 routed-MoE kernel (E4M3 tensor-core MMA, half
  the E2M1 decode work of W4A16) must answer first: what FP8 activations cost. The checkpoint model with every
  routed expert's two GEMM inputs (the layer's normed x, and the SwiGLU output into the down projection) rounded
  to E4M3 (:func:`fake_quant_e4m3`: a float32 scale per token and ``--act-quant-group`` channels, amax / 448,
  round to nearest even) against the checkpoint model as it runs today (W4A16): KL and top-1 agreement of the
  main and NEXTN heads on the first N chat test records, and both models' teacher-forced figures.
* ``greedy``: ``--greedy-n`` test questions through the engine (``bytebound.engine.engine.Engine``, batch 1,
  temperature 0, stop at ``"\\n\\n"`` / ``"Question:"``), 5-shot prompt ``few_shot_prompt(question)`` (k=5,
  seed 0), answer ``extract_answer`` vs the reference; decode speed from the engine's per-token times.
  ``--mtp`` repeats it with NEXTN speculative decoding (3 steps, chain) and reports the measured accept length
  and per-position acceptance, and whether every output equals the plain greedy one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bytebound.checkpoint.loader import load_model  # noqa: E402
from bytebound.config import LingConfig  # noqa: E402
from bytebound.data.gsm8k import (  # noqa: E402
    FEW_SHOT_STOP, answers_match, chat_messages, clean_solution, extract_answer, few_shot_prompt, load_split,
)
from bytebound.engine.tokenizer import Tokenizer  # noqa: E402
from bytebound.models.bailing_moe_v3 import BailingMoeV3ForCausalLM  # noqa: E402

TORCH_BACKENDS = {"moe": "torch", "linear": "torch", "lm_head": "torch", "kda": "torch", "mla": "torch",
                  "sampling": "torch"}


def implied_accept(p: float, steps: int = 3) -> float:
    return sum(p ** i for i in range(steps + 1))


def load_float(path, device) -> BailingMoeV3ForCausalLM:
    blob = torch.load(path, map_location="cpu", weights_only=True)
    cfg = LingConfig.from_dict(blob["config"])
    model = BailingMoeV3ForCausalLM(cfg, torch.float32)
    model.load_state_dict(blob["state_dict"])
    return model.to(device).finish_load()


def hybrid(float_path, qmodel, parts: set, device) -> BailingMoeV3ForCausalLM:
    """The float model with the weight classes in ``parts`` replaced by the checkpoint's values (``qmodel`` as
    ``load_model`` loads it): ``fp8`` block linears and ``mxfp4`` routed experts dequantised, ``rest`` every other
    parameter as stored (BF16 embeddings, norms, head...). Raises ValueError if a class matched nothing."""
    from bytebound.layers.linear import QLinear
    from bytebound.layers.moe import RoutedExperts
    from bytebound.quant import dequantize_fp8_block, dequantize_mxfp4
    h = load_float(float_path, device)
    q = dict(qmodel.named_modules())
    n = {"fp8": 0, "mxfp4": 0, "rest": 0}
    done = set()
    with torch.no_grad():
        for name, m in h.named_modules():
            src = q.get(name)
            if "fp8" in parts and isinstance(src, QLinear) and src.fmt == "fp8":
                m.weight.copy_(dequantize_fp8_block(src.weight, src.weight_scale_inv, src.block, torch.float32))
                n["fp8"] += 1
                done.add(f"{name}.weight")
            elif "mxfp4" in parts and isinstance(src, RoutedExperts) and src.fmt == "mxfp4":
                for w, sc in (("w13", "w13_scale"), ("w2", "w2_scale")):
                    pk, scale = getattr(src, w), getattr(src, sc)
                    deq = dequantize_mxfp4(pk.reshape(-1, pk.shape[-1]), scale.reshape(-1, scale.shape[-1]))
                    getattr(m, w).copy_(deq.view(getattr(m, w).shape))
                    done.add(f"{name}.{w}")
                n["mxfp4"] += 1
        if "rest" in parts:
            qp = dict(qmodel.named_parameters())
            for name, p in h.named_parameters():
                src = qp.get(name)
                if (name not in done and src is not None and src.shape == p.shape and src.is_floating_point()
                        and src.element_size() >= 2):
                    p.copy_(src.float())
                    n["rest"] += 1
    for k in parts:
        if not n[k]:
            raise ValueError(f"hybrid: no {k} weights found in the checkpoint model")
    return h.finish_load()           # MLA's absorbed kv_b copies follow the new weights


E4M3_MAX = 448.0


def fake_quant_e4m3(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x [..., C]`` rounded to FP8 E4M3 with one float32 scale per row and ``group`` channels (0: the whole row),
    scale = amax / 448 (all-zero groups stay zero), returned dequantised in x's dtype: the activations a W4A8
    kernel would feed its E4M3 MMA (dynamic per-token(-group) quantisation, as the FP8 head quantises its input).
    ``group`` -1: x unchanged (the harness's control).

    Raises:
        ValueError: ``group`` does not divide C."""
    if group < 0:
        return x
    c = x.shape[-1]
    g = group or c
    if c % g:
        raise ValueError(f"fake_quant_e4m3: group {g} does not divide {c} channels")
    xf = x.float().reshape(*x.shape[:-1], c // g, g)
    scale = xf.abs().amax(-1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(x.shape).to(x.dtype)


def w4a8_experts(ex, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """``torch_ref.moe_reference``'s routed sum with both GEMM inputs through :func:`fake_quant_e4m3`: x once per
    token, the SwiGLU output per (token, expert) row. Weights dequantised from the checkpoint's MXFP4 (float32),
    one expert at a time. ``x [M, H]``, ``ids [M, k]``, ``w [M, k]`` -> ``[M, H]`` in x's dtype."""
    from bytebound.layers.moe import swiglu
    from bytebound.quant import dequantize_mxfp4
    deq = getattr(ex, "_w4a8_deq", None)
    if deq is None:
        deq = ex._w4a8_deq = tuple(
            dequantize_mxfp4(getattr(ex, n), getattr(ex, n + "_scale")) for n in ("w13", "w2"))
    w13, w2 = deq
    m, k = ids.shape
    xq = fake_quant_e4m3(x, group).float()
    y = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    tok = torch.arange(m * k, device=x.device) // k
    for e in torch.unique(flat).tolist():
        sel = flat == e
        t = tok[sel]
        h = xq[t] @ w13[e].t()
        a = swiglu(h[:, :ex.inter], h[:, ex.inter:], ex.limit)
        y.index_add_(0, t, (fake_quant_e4m3(a, group) @ w2[e].t()) * w.reshape(-1)[sel, None].float())
    return y.to(x.dtype)


def with_w4a8_experts(model, group: int):
    """``model`` with every MXFP4 routed-expert module running :func:`w4a8_experts` (its ``fn``). Raises
    ValueError if there is none."""
    from bytebound.layers.moe import RoutedExperts
    n = 0
    for mod in model.modules():
        if isinstance(mod, RoutedExperts) and mod.fmt == "mxfp4":
            mod.fn = lambda x, ids, w, ex=mod: w4a8_experts(ex, x, ids, w, group)
            n += 1
    if not n:
        raise ValueError("with_w4a8_experts: the model has no MXFP4 routed experts")
    return model


def docs_chat(tok, recs):
    """(ids, answer_start) per record: chat prompt + solution + <|role_end|>; answer tokens start at answer_start."""
    out = []
    for r in recs:
        prompt = tok.encode(tok.apply_chat_template(chat_messages(r["question"])))
        ans = tok.encode(clean_solution(r["answer"])) + [tok.eos_token_id]
        out.append((prompt + ans, len(prompt)))
    return out


def docs_5shot(tok, recs):
    out = []
    for r in recs:
        prompt = few_shot_prompt(r["question"])
        full = tok.tok.encode(prompt + " " + clean_solution(r["answer"]), add_special_tokens=False)
        start = next(i for i, o in enumerate(full.offsets) if o[0] >= len(prompt))
        if full.ids[:start] != tok.encode(prompt):
            raise RuntimeError("5-shot prompt tokens differ inside prompt + completion (tokenisation boundary)")
        out.append((full.ids, start))
    return out


class Acc:
    def __init__(self):
        self.s = {}

    def add(self, k, num, den):
        a = self.s.setdefault(k, [0.0, 0.0])
        a[0] += float(num)
        a[1] += float(den)

    def get(self, k):
        num, den = self.s[k]
        return num / den if den else float("nan")

    def count(self, k):
        return int(self.s[k][1])


@torch.inference_mode()
def teacher_forced(model, fmodel, docs, device, batch: int, prefix: str, acc: Acc):
    """One padded batch at a time (right padding; the model is causal so padding never reaches real tokens)."""
    order = sorted(range(len(docs)), key=lambda i: len(docs[i][0]))
    for b0 in range(0, len(order), batch):
        grp = [docs[i] for i in order[b0:b0 + batch]]
        tmax = max(len(d) for d, _ in grp)
        ids = torch.zeros(len(grp), tmax, dtype=torch.int64)
        valid = torch.zeros(len(grp), tmax, dtype=torch.bool)
        ans = torch.zeros(len(grp), tmax, dtype=torch.bool)
        for j, (d, s) in enumerate(grp):
            ids[j, :len(d)] = torch.tensor(d)
            valid[j, :len(d)] = True
            ans[j, s:len(d)] = True
        ids, valid, ans = ids.to(device), valid.to(device), ans.to(device)
        pos = torch.arange(tmax - 2, device=device)
        outs = []
        for m in (model, fmodel):
            if m is None:
                outs.append(None)
                continue
            h = m(ids)
            lg = m.logits(h[:, :-1]).float()                                # predicts ids[:, 1:]
            ng = m.logits(m.nextn_forward(ids[:, 1:-1], h[:, :-2], pos)).float()   # predicts ids[:, 2:]
            outs.append((lg, ng))
        lg, ng = outs[0]
        v1, a1 = valid[:, 1:], ans[:, 1:]
        v2, a2 = valid[:, 2:], ans[:, 2:]
        nll = F.cross_entropy(lg.transpose(1, 2), ids[:, 1:], reduction="none")
        hit = lg.argmax(-1) == ids[:, 1:]
        nhit = ng.argmax(-1) == ids[:, 2:]
        agree = ng.argmax(-1) == lg[:, 1:].argmax(-1)       # NEXTN(t) vs target's own top-1 at t+1, both for t+2
        acc.add(f"{prefix}answer_nll", (nll * a1).sum(), a1.sum())
        acc.add(f"{prefix}answer_top1", (hit & a1).sum(), a1.sum())
        acc.add(f"{prefix}all_top1", (hit & v1).sum(), v1.sum())
        acc.add(f"{prefix}nextn_top1_all", (nhit & v2).sum(), v2.sum())
        acc.add(f"{prefix}nextn_top1_answer", (nhit & a2).sum(), a2.sum())
        acc.add(f"{prefix}nextn_agree_all", (agree & v2).sum(), v2.sum())
        acc.add(f"{prefix}nextn_agree_answer", (agree & a2).sum(), a2.sum())
        if outs[1] is not None:
            flg, fng = outs[1]
            for name, q, p, v in (("main", lg, flg, v1), ("nextn", ng, fng, v2)):
                lp, lq = F.log_softmax(p, -1), F.log_softmax(q, -1)
                kl = (lp.exp() * (lp - lq)).sum(-1)
                acc.add(f"{prefix}kl_{name}", (kl * v).sum(), v.sum())
                acc.add(f"{prefix}agree_{name}", ((p.argmax(-1) == q.argmax(-1)) & v).sum(), v.sum())


def tf_report(acc: Acc, prefix: str, has_float: bool) -> dict:
    r = {"answer_tokens": acc.count(f"{prefix}answer_nll"),
         "answer_ppl": math.exp(acc.get(f"{prefix}answer_nll")), "answer_nll": acc.get(f"{prefix}answer_nll"),
         "answer_top1": acc.get(f"{prefix}answer_top1"), "all_positions_top1": acc.get(f"{prefix}all_top1"),
         "all_positions": acc.count(f"{prefix}all_top1"),
         "nextn_top1_all_positions": acc.get(f"{prefix}nextn_top1_all"),
         "nextn_top1_answer_positions": acc.get(f"{prefix}nextn_top1_answer"),
         "nextn_agree_target_top1_all_positions": acc.get(f"{prefix}nextn_agree_all"),
         "nextn_agree_target_top1_answer_positions": acc.get(f"{prefix}nextn_agree_answer")}
    if has_float:
        r["quant_vs_float"] = {"kl_main_nats_per_token": acc.get(f"{prefix}kl_main"),
                               "top1_agreement_main": acc.get(f"{prefix}agree_main"),
                               "kl_nextn_nats_per_token": acc.get(f"{prefix}kl_nextn"),
                               "top1_agreement_nextn": acc.get(f"{prefix}agree_nextn"),
                               "positions": acc.count(f"{prefix}kl_main")}
    return r


def greedy(ckpt, device, recs, max_tokens: int, steps: int, log_every: int = 20) -> tuple[dict, list]:
    from bytebound.engine.engine import Engine, EngineConfig
    from bytebound.sampling import SamplingParams
    eng = Engine(EngineConfig(model=str(ckpt), device=str(device), dtype="fp32", backends=dict(TORCH_BACKENDS),
                              speculative_steps=steps))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=FEW_SHOT_STOP)
    rows, t0 = [], time.time()
    correct = 0
    for i, r in enumerate(recs):
        out = eng.generate(few_shot_prompt(r["question"]), params)[0]
        pred = extract_answer(out.text)
        ok = answers_match(pred, r["final"])
        correct += ok
        rows.append({"idx": r["idx"], "pred": pred, "gold": r["final"], "correct": ok, "text": out.text,
                     "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                     "finish": out.finish_reason, "ttft_s": out.ttft_s, "tpot_s": out.tpot_s,
                     "accept_length": out.spec["accept_length"] if out.spec else None})
        if (i + 1) % log_every == 0 or i + 1 == len(recs):
            print(f"[eval] {'mtp' if steps else 'greedy'} {i + 1}/{len(recs)}: {correct} correct, "
                  f"{time.time() - t0:.0f}s", flush=True)
    n_tok = sum(x["completion_tokens"] for x in rows)
    dec_time = sum(x["tpot_s"] * max(0, x["completion_tokens"] - 1) for x in rows)
    res = {"n": len(rows), "correct": correct, "exact_match": correct / len(rows),
           "completion_tokens": n_tok, "mean_completion_tokens": n_tok / len(rows),
           "mean_prompt_tokens": sum(x["prompt_tokens"] for x in rows) / len(rows),
           "finish_length": sum(x["finish"] == "length" for x in rows),
           "decode_tok_s": (sum(max(0, x["completion_tokens"] - 1) for x in rows) / dec_time) if dec_time else None,
           "mean_ttft_s": sum(x["ttft_s"] for x in rows) / len(rows), "wall_s": time.time() - t0,
           "device": str(device), "threads": torch.get_num_threads()}
    if steps:
        res["spec"] = eng.spec_totals.to_dict()
    return res, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=str(ROOT / "models" / "ling-nano"))
    ap.add_argument("--float-weights", default=None, help="nano_float.pt from train_nano.py (quant-vs-float figures)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--samples-out", default=None, help="write per-question greedy outputs (JSONL) here")
    ap.add_argument("--tf-n", type=int, default=0, help="test records for the chat teacher-forced pass (0: all)")
    ap.add_argument("--tf5-n", type=int, default=200, help="test records for the 5-shot teacher-forced pass")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--greedy-n", type=int, default=200)
    ap.add_argument("--greedy-start", type=int, default=0, help="first test index of the greedy slice")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--mtp", action="store_true", help="also run the greedy slice with NEXTN speculative decoding")
    ap.add_argument("--mtp-n", type=int, default=0, help="questions for the MTP run (0: same as --greedy-n)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quant-ablation", type=int, default=0,
                    help="with --float-weights: chat test records for the per-weight-class quantisation ablation")
    ap.add_argument("--act-quant", type=int, default=0,
                    help="chat test records for the W4A8 ablation (E4M3 activations into the routed experts)")
    ap.add_argument("--act-quant-group", default="-1,128,0",
                    help="comma-separated channels per activation scale for --act-quant (0: one scale per row; -1: no "
                         "rounding, the control: the same expert code must reproduce the checkpoint model)")
    a = ap.parse_args(argv)
    if a.act_quant < 0:
        ap.error("--act-quant N needs N >= 0")
    if a.quant_ablation < 0 or (a.quant_ablation and not a.float_weights):
        ap.error("--quant-ablation N needs N >= 0 and --float-weights")
    if a.quant_ablation and a.tf_n < 0 and a.tf5_n <= 0:
        ap.error("--quant-ablation runs with the teacher-forced pass: do not disable it (--tf-n >= 0)")
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    t_all = time.time()
    tok = Tokenizer.from_dir(a.ckpt)
    test = load_split("test")
    report = {"ckpt": str(a.ckpt), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "split": "test", "test_records": len(test)}
    ck = Path(a.ckpt)
    report["checkpoint_bytes"] = {f.name: f.stat().st_size for f in sorted(ck.iterdir()) if f.is_file()}
    report["checkpoint_total_bytes"] = sum(report["checkpoint_bytes"].values())

    need_tf = a.tf_n >= 0 or a.tf5_n > 0 or a.act_quant > 0
    if need_tf:
        t0 = time.time()
        model = load_model(a.ckpt, dev, torch.float32)
        fmodel = load_float(a.float_weights, dev) if a.float_weights else None
        if dev.type == "cpu":
            # The torch backends, bound: same functions as the unbound modules use, with dequantised copies kept
            # (CPU speed). On CUDA the unbound modules run the same torch code and no optional kernel module is
            # imported.
            from bytebound.runner.backends import BackendPlan, bind_model
            for m in (model, fmodel):
                if m is not None:
                    bind_model(m, BackendPlan(dict(TORCH_BACKENDS)), dev)
        acc = Acc()
        tf = {}
        if a.tf_n >= 0:
            recs = test if a.tf_n == 0 else test[: a.tf_n]
            teacher_forced(model, fmodel, docs_chat(tok, recs), dev, a.batch, "chat_", acc)
            tf["chat"] = {"records": len(recs), **tf_report(acc, "chat_", fmodel is not None)}
            print(f"[eval] chat teacher-forced ({len(recs)} records) {time.time() - t0:.0f}s: "
                  f"{json.dumps(tf['chat'])}", flush=True)
        if a.tf5_n > 0:
            recs = test[: a.tf5_n]
            teacher_forced(model, fmodel, docs_5shot(tok, recs), dev, max(1, a.batch // 4), "shot_", acc)
            tf["five_shot"] = {"records": len(recs), **tf_report(acc, "shot_", fmodel is not None)}
            print(f"[eval] 5-shot teacher-forced ({len(recs)} records) {time.time() - t0:.0f}s: "
                  f"{json.dumps(tf['five_shot'])}", flush=True)
        report["teacher_forced"] = tf
        imp = {"formula": "1 + p + p^2 + p^3 (3 chain drafts, independent per-draft acceptance p, + bonus token)"}
        for k, v in tf.items():
            for key in ("nextn_top1_answer_positions", "nextn_agree_target_top1_answer_positions",
                        "nextn_top1_all_positions", "nextn_agree_target_top1_all_positions"):
                imp[f"{k}.{key}"] = {"p": v[key], "accept_length": implied_accept(v[key])}
        report["implied_accept_length"] = imp
        if a.quant_ablation and fmodel is not None:
            recs = test[: a.quant_ablation]
            cacc = Acc()
            teacher_forced(model, fmodel, docs_chat(tok, recs), dev, a.batch, "c_", cacc)
            abl = {"checkpoint": tf_report(cacc, "c_", True)["quant_vs_float"]}
            for label, parts in (("fp8_linears_only", {"fp8"}), ("mxfp4_experts_only", {"mxfp4"}),
                                 ("bf16_storage_only", {"rest"}), ("all_from_checkpoint", {"fp8", "mxfp4", "rest"})):
                hm = hybrid(a.float_weights, model, parts, dev)
                hacc = Acc()
                teacher_forced(hm, fmodel, docs_chat(tok, recs), dev, a.batch, "h_", hacc)
                abl[label] = tf_report(hacc, "h_", True)["quant_vs_float"]
                print(f"[eval] quant ablation {label}: {json.dumps(abl[label])}", flush=True)
                del hm
            report["quant_ablation"] = {"records": len(recs), **abl}
        if a.act_quant:
            recs = test[: a.act_quant]
            aq = {"records": len(recs), "what": "routed experts' GEMM inputs in E4M3 (W4A8) vs the checkpoint "
                                                "model as it runs (W4A16); KL(P_w4a16 || P_w4a8)"}
            for group in (int(g) for g in a.act_quant_group.split(",")):
                qm = with_w4a8_experts(load_model(a.ckpt, dev, torch.float32), group)
                qacc = Acc()
                teacher_forced(qm, model, docs_chat(tok, recs), dev, a.batch, "q_", qacc)
                r = tf_report(qacc, "q_", True)
                r["w4a8_vs_w4a16"] = r.pop("quant_vs_float")
                label = "control" if group < 0 else f"group_{group or 'row'}"
                aq[label] = r
                print(f"[eval] W4A8 ablation, {label}: {json.dumps(r)}", flush=True)
                del qm
            bacc = Acc()
            teacher_forced(model, None, docs_chat(tok, recs), dev, a.batch, "b_", bacc)
            aq["w4a16_checkpoint"] = tf_report(bacc, "b_", False)
            report["act_quant_ablation"] = aq
        del model, fmodel
        report["teacher_forced_s"] = time.time() - t0

    samples = []
    if a.greedy_n > 0:
        recs = test[a.greedy_start: a.greedy_start + a.greedy_n]
        g, rows = greedy(a.ckpt, dev, recs, a.max_tokens, 0)
        g["test_indices"] = [a.greedy_start, a.greedy_start + len(recs)]
        report["greedy"] = g
        samples = rows
        print(f"[eval] greedy: {json.dumps(g)}", flush=True)
        if a.mtp:
            mrecs = recs[: a.mtp_n] if a.mtp_n else recs
            m, mrows = greedy(a.ckpt, dev, mrecs, a.max_tokens, 3)
            m["identical_to_greedy"] = sum(x["text"] == y["text"] for x, y in zip(mrows, rows))
            report["mtp"] = m
            print(f"[eval] mtp: {json.dumps(m)}", flush=True)
            for x, y in zip(rows, mrows):
                x["mtp_text_identical"] = x["text"] == y["text"]
                x["mtp_accept_length"] = y["accept_length"]
    report["wall_s"] = time.time() - t_all
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    if a.samples_out and samples:
        Path(a.samples_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.samples_out).write_text("".join(json.dumps(s) + "\n" for s in samples))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
