"""Which proposer drafts for a ``speculative_config``: chosen once, when the engine is built. Kept apart
from the interface (``proposer.py``), which every proposer imports."""

from __future__ import annotations

from kimitui.engine.spec_decode.dspark.proposer import DSparkProposer
from kimitui.engine.spec_decode.eagle3.proposer import Eagle3Proposer
from kimitui.engine.spec_decode.ngram import NgramProposer
from kimitui.engine.spec_decode.proposer import Proposer
from kimitui.engine.spec_decode.suffix import SuffixProposer


def make_proposer(config, target=None, model_dir=None) -> Proposer:
    """The proposer of ``config.method``; ``target``: the loaded target model (eagle3 shares its
    embedding and reads its config); ``model_dir``: the target's checkpoint (eagle3 under tensor
    parallel reads the whole embedding from it)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )
    if config.method == "eagle3":
        return Eagle3Proposer(config, target, model_dir=model_dir)
    if config.method == "dspark":
        return DSparkProposer(config, target, model_dir=model_dir)
    raise ValueError(f"speculative_config: no proposer for method {config.method!r}")
