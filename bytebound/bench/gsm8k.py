"""GSM8K benchmark: 5-shot prompts (exemplars from train), the test questions, accuracy and latency.

Sampling defaults follow the seed's end-to-end evaluation: temperature 0.6, top-p 0.95, top-k 29, one seed per
question (``seed + idx``). The completion stops at ``FEW_SHOT_STOP`` (the next exemplar) or ``max_tokens``;
the answer is :func:`bytebound.data.gsm8k.extract_answer` (first number after ``####``, commas stripped) and
it is compared numerically with the reference ``#### N``.
"""

from __future__ import annotations

from bytebound.data.gsm8k import FEW_SHOT_STOP, answers_match, extract_answer, few_shot_prompt, load_split
from bytebound.errors import RequestError
from bytebound.sampling import SamplingParams


def gsm8k_requests(limit: int | None = None, shots: int = 5, seed: int = 0) -> list[dict]:
    """The first ``limit`` test records (all 1319 by default), each with its k-shot ``prompt``."""
    recs = load_split("test")
    if limit is not None:
        recs = recs[:limit]
    for r in recs:
        r["prompt"] = few_shot_prompt(r["question"], k=shots, seed=seed)
    return recs


def run_gsm8k(engine, limit: int | None = None, shots: int = 5, seed: int = 0, max_tokens: int = 512,
              temperature: float = 0.6, top_p: float = 0.95, top_k: int = 29, progress: bool = True,
              warmup: int = 1) -> dict:
    """Run the questions one at a time (batch 1). ``max_tokens`` is clamped per question to the room left in
    ``max_model_len`` (recorded); a prompt that does not fit at all is recorded as skipped and left out of the
    accuracy (``n`` counts answered questions, ``skipped`` the others).

    Raises:
        RequestError: no tokenizer, or every question was skipped (nothing was measured).
    """
    from tqdm import tqdm
    if engine.tokenizer is None:
        raise RequestError("bench gsm8k needs a tokenizer: use a checkpoint directory, not --load-format dummy")
    recs = gsm8k_requests(limit, shots, seed)
    room = engine.runner.max_len - engine.config.speculative_steps - 1
    outputs, rows, correct = [], [], 0
    bar = tqdm(recs, desc="gsm8k", unit="q", disable=not progress)
    for r in bar:
        ids = engine.encode_prompt(r["prompt"])
        mt = min(max_tokens, room - len(ids))
        row = {"idx": r["idx"], "gold": r["final"], "prompt_tokens": len(ids), "max_tokens": mt}
        if mt < 1:
            rows.append({**row, "pred": None, "correct": False, "skipped": "prompt does not fit max_model_len"})
            continue
        if warmup:       # untimed, on the tail of the first prompt that fits (a fixed one may not fit max_model_len)
            engine.generate(ids[-64:], SamplingParams(max_tokens=min(4, mt)))
            warmup = 0
        p = SamplingParams(max_tokens=mt, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + r["idx"],
                           stop=FEW_SHOT_STOP)
        out = engine.generate(ids, p)[0]
        pred = extract_answer(out.text)
        ok = answers_match(pred, r["final"])
        correct += ok
        outputs.append(out)
        rows.append({**row, "pred": pred, "correct": ok, "completion_tokens": out.completion_tokens,
                     "finish_reason": out.finish_reason, "ttft_ms": out.ttft_s * 1e3, "tpot_ms": out.tpot_s * 1e3,
                     "e2e_ms": out.e2e_s * 1e3,
                     "accept_length": out.spec["accept_length"] if out.spec else None, "text": out.text})
        bar.set_postfix(acc=f"{correct / len(outputs):.3f}", tpot_ms=f"{out.tpot_s * 1e3:.1f}")
    skipped = len(rows) - len(outputs)
    if recs and not outputs:
        raise RequestError(f"all {skipped} question(s) skipped: prompt does not fit max_model_len "
                           f"{engine.runner.max_len} (shortest {shots}-shot prompt "
                           f"{min(r['prompt_tokens'] for r in rows)} tokens, room for {room - 1} with one output "
                           "token); raise --max-model-len or lower --shots")
    return {"outputs": outputs, "rows": rows, "correct": correct, "n": len(outputs), "skipped": skipped,
            "sampling": {"shots": shots, "seed": seed, "max_tokens": max_tokens, "temperature": temperature,
                         "top_p": top_p, "top_k": top_k, "stop": list(FEW_SHOT_STOP)}}
