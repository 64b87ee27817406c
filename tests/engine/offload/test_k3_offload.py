"""Kimi K3 with most routed experts in host RAM (``cpu_offload``): the MXFP4 host experts, computed
by the CPU expert executor, give the tokens and prompt log-probs of a run with every expert local."""

from kimitui.engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
PROMPT = {"prompt_token_ids": list(range(100, 140))}


def test_k3_host_experts_match_local_experts():
    with LLM(model="demo-k3", max_model_len=256, max_num_seqs=2, cpu_offload="none") as llm:
        local = llm.generate(PROMPT, PARAMS)[0]
        n = llm.engine.config.n_routed_experts
    with LLM(model="demo-k3", max_model_len=256, max_num_seqs=2, cpu_offload=n - 2) as llm:
        hosts = [m.host for m in llm.engine.model.modules() if getattr(m, "host", None) is not None]
        # packed in host RAM, as the CPU kernels' tiles (the same MXFP4 bytes, reordered at load)
        assert hosts and all(h.num == n - 2 and h.fmt == "tiles" and h.tiled_fmt == "mxfp4" for h in hosts)
        offloaded = llm.generate(PROMPT, PARAMS)[0]
    assert offloaded.outputs[0].token_ids == local.outputs[0].token_ids
    for i in range(1, len(PROMPT["prompt_token_ids"])):
        for tok, lp in local.prompt_logprobs[i].items():
            assert abs(offloaded.prompt_logprobs[i][tok] - lp) < 1e-4
