"""Per-token logprobs (``SamplingParams.logprobs``) on CUDA with the engine's defaults (captured decode graph, token
graphs and pipelined plain decoding for requests without logprobs; BF16): a logprobs request emits plain decoding's
tokens, and each record is the log-softmax of the logits its token was chosen from, checked against a float64
log-softmax of the plain decode's logits replayed independently (``verify.canaries.replay_plain_logits``: the prompt's
prefill, then one decode step per token). The CPU tests (tests/test_logprobs.py) check the same records against a
from-scratch float64 recomputation of the unbound model."""

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU: run scripts/gpu_check.sh on the device")]

NANO = Path(__file__).resolve().parents[2] / "models" / "ling-nano"
K = 5
N = 24
# the record's float32 log-softmax vs float64 of the same (replayed, bit-equal) logits
TOL = 1e-4


@pytest.fixture(scope="module")
def engines():
    if not (NANO / "model.safetensors").exists():
        pytest.skip("trained ling-nano weights not present")
    from bytebound.engine.engine import Engine
    plain = Engine(model=str(NANO), device="cuda")
    spec = Engine(model=str(NANO), device="cuda", speculative_steps=3)
    assert plain.runner.graph is not None and plain.pipelined, "the CUDA defaults capture and pipeline decoding"
    return plain, spec


PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
           "How many clips did Natalia sell altogether in April and May?",
           "Write one sentence about the sea."]


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.6, top_p=0.95, top_k=29, seed=3)],
                         ids=["greedy", "sampled"])
@torch.inference_mode()
def test_logprobs_tokens_and_records_on_cuda(engines, params):
    from bytebound.sampling import SamplingParams
    from bytebound.verify.canaries import replay_plain_logits
    plain, spec = engines
    for q in PROMPTS:
        base = SamplingParams(max_tokens=N, ignore_eos=True, **params)
        want = plain.generate(q, base, chat=True)[0]
        lp = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=K, **params)
        got = plain.generate(q, lp, chat=True)[0]
        # the same tokens as plain decoding through the captured token graphs (pipelined)
        assert got.token_ids == want.token_ids and len(got.logprobs) == N
        # an MTP engine decodes a logprobs request plainly: the same tokens and records, no speculation
        s = spec.generate(q, lp, chat=True)[0]
        assert s.token_ids == got.token_ids and s.spec is None
        assert [r.token_id for r in s.logprobs] == got.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(s.logprobs, got.logprobs)) < TOL
        prompt = plain.encode_prompt(q, chat=True)
        for i in (0, 1, N // 2, N - 1):
            ref = torch.log_softmax(replay_plain_logits(plain, prompt, got.token_ids[:i]).double(), -1)
            rec = got.logprobs[i]
            assert rec.token_id == got.token_ids[i] and rec.logprob <= 0
            assert abs(rec.logprob - ref[rec.token_id].item()) < TOL, (i, rec.logprob, ref[rec.token_id].item())
            ids, vals = zip(*rec.top)
            top = ref.topk(K)
            assert max(abs(a - b) for a, b in zip(vals, top.values.tolist())) < TOL
            # ids equal the reference's top K except where two logprobs tie within the tolerance
            for j, (a, b) in enumerate(zip(ids, top.indices.tolist())):
                assert a == b or abs(ref[a].item() - ref[b].item()) < TOL, (i, j, a, b)
            if not params:      # greedy: the chosen token has the largest logprob (on an exact tie topk may list
                #                     the other token first, argmax picks the lower id: compare values)
                assert rec.top[0][1] == rec.logprob
