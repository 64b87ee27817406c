"""Greedy generation for the end-to-end children that compare paths token by token."""

from __future__ import annotations


def greedy_run(llm, prompts: list[list[int]], max_tokens: int):
    """Generate from token-id ``prompts`` greedily, counting launches. -> (record, counts): record has,
    per prompt, the generated ``tokens`` and the log-probs of the prompt's (``prompt_lp``) and the
    generated tokens (``gen_lp``); counts is ``kernels.launch_count.count_launches``'s."""
    from kimitui.engine import SamplingParams
    from kimitui.kernels.launch_count import count_launches

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    with count_launches() as counts:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    record = {"tokens": [], "prompt_lp": [], "gen_lp": []}
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0]
        record["tokens"].append(list(gen.token_ids))
        record["prompt_lp"].append([d[t] for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        record["gen_lp"].append([d[t] for d, t in zip(gen.logprobs, gen.token_ids)])
    return record, counts
