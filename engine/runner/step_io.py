"""What a rank's model runner takes and gives per step (engine/runner/model_runner.py): the step's inputs as
plain Python (``StepInputs``, pickled to tensor-parallel workers), the sampled result (``StepResult``), and
which batch rows a step's output needs (``output_rows``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kimitui.engine.outputs import LogprobRows
from kimitui.engine.spec_decode.proposer import StepHidden


@dataclass
class PromptLogprobSpan:
    seq_id: str
    row: int  # first row of the chunk in the batch
    num_rows: int  # rows whose next token is still a prompt token
    first_pos: int  # position of the first prompt token these rows predict
    next_ids: list[int]
    k: int | None  # top-k of the log-prob dicts (prompt_logprobs), None: no dicts
    full: bool = False  # full-vocabulary rows too (SamplingParams.logprob_rows)


@dataclass
class StepInputs:
    """Everything a rank needs to run one step; plain Python so it pickles to workers."""

    ids: list[int]
    num_decodes: int
    decode_tables: list[list[int]]  # explicit tables; empty when the step uses ``decode_rows``
    decode_lens: list[int]
    prefills: list[tuple[int, int, int, list[int]]]  # (start row, end row, context_len, block_table)
    sample_rows: list[int]
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)
    # Hybrid models only (empty otherwise): each sequence's state slot in row order (decodes, then
    # prefill chunks), the slots to zero (sequences at position 0) and the scheduler's
    # (from, to) slot copies before and after the forward pass.
    state_slots: list[int] = field(default_factory=list)
    state_resets: list[int] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: rows of each decoding sequence, in order (1 = a plain decode). Empty when
    # no sequence of the step verifies drafts.
    spec_lens: list[int] = field(default_factory=list)
    keep_all_rows: bool = False  # a model drafter reads every row's hidden state
    # Forks: (source, destination) block ids whose rows every paged layer copies after the forward pass
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Persistent decode tables (engine/runner/block_tables.py), in place of ``decode_tables``: each decode
    # row's table row, and the (row, first column, block ids) writes that bring the tables up to date first
    decode_rows: list[int] = field(default_factory=list)
    table_writes: list[tuple[int, int, list[int]]] = field(default_factory=list)


@dataclass
class StepResult:
    # per scheduled seq: the sampled token; for a decode that verified drafts the list of its
    # accepted drafts then one sampled token; None when the chunk did not reach the end
    sampled: list[int | list[int] | None]
    logprobs: list[dict[int, float] | list[dict[int, float]] | None]  # per scheduled seq, when asked
    # seq_id -> (position of the first token covered, log-probs of prompt tokens from there on)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    hidden: StepHidden | None = None  # the target's aux hidden states, when a model drafter reads them
    # seq_id -> full-vocabulary log-prob rows of this step (SamplingParams.logprob_rows), in position order
    rows: dict[str, list[LogprobRows]] = field(default_factory=dict)


def output_rows(inp: StepInputs) -> tuple[list[int] | None, list[tuple[int, int]]]:
    """The batch rows whose hidden state the step uses, and each prefill chunk's [start, end) among
    them; ``(None, [])`` when that is every row.

    Every decode samples. A prefill chunk needs all its rows for prompt log-probs (a span starts at
    its first row), else its last row if it samples, else none; so each chunk keeps a suffix. A
    step that needs no row at all (only unfinished prompts) keeps its final row, so that no layer
    sees an empty batch.
    """
    spans = {sp.row for sp in inp.prompt_spans}
    samples = set(inp.sample_rows)
    firsts = [a if a in spans else b - 1 if b - 1 in samples else b for a, b, *_ in inp.prefills]
    if not inp.num_decodes and inp.prefills and all(f == b for f, (_, b, *_) in zip(firsts, inp.prefills)):
        firsts[-1] -= 1
    kept = inp.num_decodes + sum(b - f for f, (_, b, *_) in zip(firsts, inp.prefills))
    if kept == len(inp.ids):
        return None, []
    keep = list(range(inp.num_decodes))
    bounds = []
    for f, (_, b, *_) in zip(firsts, inp.prefills):
        bounds.append((len(keep), len(keep) + b - f))
        keep.extend(range(f, b))
    return keep, bounds
