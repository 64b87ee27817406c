"""``SpeculativeConfig``: the ``speculative_config`` dict users pass (vLLM's keys), checked once.

Keys with vLLM's names, meanings and defaults (``vllm/config/speculative.py``; ``disable_by_batch_size``
as vLLM's V0 engine read it), so a recipe's JSON pastes unchanged:

- ``method``: ``ngram``, ``suffix``, ``eagle3``, ``dspark``; ``num_speculative_tokens`` (dspark: the
  block width); ``model`` (the drafter checkpoint, eagle3 and dspark); ``draft_tensor_parallel_size`` (the drafter runs on rank 0 whatever it says).
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram; one given sets the other, none gives 5 and 5).
- the suffix tree's ``suffix_decoding_max_tree_depth`` (24), ``suffix_decoding_max_cached_requests``
  (10000), ``suffix_decoding_max_spec_factor`` (1.0), ``suffix_decoding_min_token_prob`` (0.1).
- ``draft_sample_method``: ``greedy`` (drafts are the drafter's argmax, verified as one-hot guesses);
  ``probabilistic`` (eagle3, dspark: each draft sampled from the drafter's distribution at the request's
  temperature / top-k / top-p; that distribution q goes to the rejection rule: accept with min(1, p / q)).
- ``rejection_sample_method``: how sampled requests' drafts are verified (greedy ones: accept while
  the draft is the argmax, under either). ``standard``: per-token rejection sampling (Leviathan et
  al. 2023): accept each draft with min(1, p / q), at the first rejection draw from
  norm(max(0, p - q)). ``block`` (vLLM's DSpark recipe): block verification (Sun et al., arXiv
  2403.10444; ``block_verify.py``): a running weight min(1, w * p / q) through the block decides
  which prefix to keep as a whole, then one token from norm(max(0, w * p - q)); exact as well, and
  never fewer drafts kept in expectation.
- ``disable_by_batch_size``: no drafts in a step whose batch holds more than this many sequences.
- ``eagle_aux_hidden_state_layer_ids``: the target layers an EAGLE-3 drafter reads, overriding its
  config; ``eagle_aux_hidden_state_layer_convention`` (ours): ``input`` (id k = the hidden state
  entering layer k, vLLM's reading) or ``output`` (id k = layer k's output, SGLang's and DSpark's).
- ``max_model_len``: the drafter's longest context; a sequence longer than that decodes without drafts.
- ``kv_cache_dtype`` / ``draft_kv_cache_dtype``: the drafter's KV cache dtype (``auto``: the model's).
- ``enforce_eager``, ``disable_padded_drafter_batch``: accepted (performance knobs of vLLM's CUDA
  graphs and padding that the drafter here has no use for); ``quantization``, ``revision``,
  ``code_revision``: accepted when null.
- ``backoff`` (ours, default true): each request's draft length follows its recent acceptance (down
  to none, probing again), so a drafter that keeps missing costs little; false drafts the full length.

Unknown keys and unsupported values are a one-line error naming the key (and the supported values),
so a typo never silently turns speculation off or changes its meaning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix", "eagle3", "dspark")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")
AUX_CONVENTIONS = ("input", "output")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
# vLLM's other methods and values, named so the error says they are known but not built here
_KNOWN_ELSEWHERE = {
    "method": ("dflash", "eagle", "medusa", "mlp_speculator", "draft_model", "mtp", "ngram_gpu", "custom_class"),
    "rejection_sample_method": ("synthetic",),
}


def _choice(key: str, value, supported: tuple[str, ...]) -> None:
    if value not in supported:
        note = " (vLLM's, not supported here)" if value in _KNOWN_ELSEWHERE.get(key, ()) else ""
        raise ValueError(f"speculative_config: {key} {value!r}{note}: supported {', '.join(supported)}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int | None = None  # accepted for vLLM compatibility; the drafter runs on rank 0
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    disable_by_batch_size: int | None = None
    max_model_len: int | None = None
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None = None
    eagle_aux_hidden_state_layer_convention: str | None = None  # None: the drafter config's, else "input"
    kv_cache_dtype: str = "auto"
    draft_kv_cache_dtype: str | None = None  # an alias of kv_cache_dtype
    enforce_eager: bool | None = None
    disable_padded_drafter_batch: bool = False
    quantization: None = None
    revision: None = None
    code_revision: None = None
    backoff: bool = True

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        _choice("method", self.method, METHODS)
        if self.method == "suffix" and self.num_speculative_tokens is None:
            set_("num_speculative_tokens", self.suffix_decoding_max_tree_depth)  # as vLLM
        if self.num_speculative_tokens is None:
            raise ValueError(f"speculative_config: method {self.method!r} needs num_speculative_tokens")
        if not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in 1..64, "
                f"got {self.num_speculative_tokens!r}"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (
                (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            )
            if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
                raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min ({lo}) <= prompt_lookup_max ({hi})")
            set_("prompt_lookup_min", lo)
            set_("prompt_lookup_max", hi)
        if self.method in ("eagle3", "dspark") and not self.model:
            raise ValueError(
                f"speculative_config: method {self.method!r} needs model (the drafter checkpoint directory)"
            )
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(
                "speculative_config: suffix_decoding_max_tree_depth must be >= 1 and "
                "suffix_decoding_max_cached_requests >= 0"
            )
        _choice("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        if self.draft_sample_method == "probabilistic" and self.method not in ("eagle3", "dspark"):
            raise ValueError(
                f"speculative_config: draft_sample_method 'probabilistic' needs a model drafter "
                f"(eagle3 or dspark), not method {self.method!r} (supported for it: greedy)"
            )
        _choice("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        if self.disable_by_batch_size is not None and (
            not _is_int(self.disable_by_batch_size) or self.disable_by_batch_size < 1
        ):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}"
            )
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"speculative_config: max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        self._check_aux_keys(set_)
        if self.draft_kv_cache_dtype is not None:
            _choice("draft_kv_cache_dtype", self.draft_kv_cache_dtype, KV_CACHE_DTYPES)
            if self.kv_cache_dtype not in ("auto", self.draft_kv_cache_dtype):
                raise ValueError(
                    f"speculative_config: kv_cache_dtype {self.kv_cache_dtype!r} and "
                    f"draft_kv_cache_dtype {self.draft_kv_cache_dtype!r} disagree"
                )
            set_("kv_cache_dtype", self.draft_kv_cache_dtype)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        for key in ("enforce_eager", "disable_padded_drafter_batch", "backoff"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"speculative_config: {key} must be true or false, got {v!r}")
        for key in ("quantization", "revision", "code_revision"):
            if getattr(self, key) is not None:
                raise ValueError(
                    f"speculative_config: {key} {getattr(self, key)!r}: supported null only "
                    f"(the drafter is read as stored in its directory)"
                )

    def _check_aux_keys(self, set_) -> None:
        ids, conv = self.eagle_aux_hidden_state_layer_ids, self.eagle_aux_hidden_state_layer_convention
        if (ids is not None or conv is not None) and self.method != "eagle3":
            key = "eagle_aux_hidden_state_layer_ids" if ids is not None else "eagle_aux_hidden_state_layer_convention"
            raise ValueError(f"speculative_config: {key} applies to method eagle3 only, not {self.method!r}")
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(k) and k >= 0 for k in ids):
                raise ValueError(
                    f"speculative_config: eagle_aux_hidden_state_layer_ids must be a non-empty "
                    f"list of layer ids >= 0, got {ids!r}"
                )
            if len(set(ids)) != len(ids):
                raise ValueError(
                    f"speculative_config: eagle_aux_hidden_state_layer_ids must be distinct, got {list(ids)}"
                )
            set_("eagle_aux_hidden_state_layer_ids", tuple(ids))
        if conv is not None:
            _choice("eagle_aux_hidden_state_layer_convention", conv, AUX_CONVENTIONS)

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI's ``--speculative-config``), a SpeculativeConfig or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError(f"speculative_config: 'method' is required ({', '.join(METHODS)})")
        return cls(**value)

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a drafter may write past the verified tokens (model drafters chain through them)."""
        return self.num_speculative_tokens if self.method == "eagle3" else 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
