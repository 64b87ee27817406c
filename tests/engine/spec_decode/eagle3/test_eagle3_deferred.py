"""Back-off with an EAGLE-3 drafter: a sequence that gets no drafts in a step costs no drafter pass.
Its verified rows wait and are absorbed in one pass when it drafts again, so its drafts are what a
drafter that absorbed every step would make (test_eagle3_engine.py checks every draft against a
dense recomputation with back-off on). Here: a drafter that never helps (random weights) under
back-off runs far fewer passes than there are decode steps, and greedy output is unchanged."""

from __future__ import annotations

from kimitui.engine import LLM, SamplingParams
from tests.helpers.checkpoints import BASE, write_hf_checkpoint
from tests.helpers.spec.eagle3_mla_checkpoint import write_mla_checkpoint


def test_no_drafter_pass_for_sequences_without_drafts(tmp_path):
    target, drafter = tmp_path / "k2", tmp_path / "mla"
    write_hf_checkpoint(target, seed=3, num_hidden_layers=4)
    write_mla_checkpoint(drafter, {**BASE, "num_hidden_layers": 4}, aux_layer_ids=(1, 2, 4), seed=2)
    prompt = [5, 17, 33, 91, 120, 7, 64]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(target), dtype="float32", max_model_len=128, max_num_seqs=2)
    ref = list(plain.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)
    plain.engine.shutdown()
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3}
    llm = LLM(str(target), dtype="float32", max_model_len=128, max_num_seqs=2, speculative_config=spec)
    out = list(llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids)
    prop, st = llm.engine.proposer, llm.engine.stats().spec_decode
    llm.engine.shutdown()
    assert out == ref
    assert st.acceptance_rate is not None and st.acceptance_rate < 0.2  # a drafter that does not help
    steps = 48 - 1 - st.num_accepted_tokens  # decode steps after the prefill
    # drafting steps run 1 absorb + (k - 1) chain passes; the back-off steps between them none
    assert prop.drafter_passes < steps / 2, (prop.drafter_passes, steps, st.num_drafts)
    print(
        f"\n{steps} decode steps, {st.num_drafts} verified drafts, {prop.drafter_passes} drafter passes, "
        f"{prop.absorbed_rows} rows absorbed"
    )
