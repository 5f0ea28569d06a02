"""The inference engine's section (EngineConfig): how its paged KV cache is cut and how many requests
it serves at once. Not a part of the run's Config: a server or a batch job builds it."""

from __future__ import annotations

import dataclasses

from jaxformer.config.base import check_field_types, require


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The paged KV cache and the scheduler of `jaxformer.engine.Engine`.

    Attributes:
        page_size: positions a page holds; a prefix is shared in whole pages.
        num_pages: pages of the pool (per layer, keys and values), page 0 scratch.
        max_slots: sequences decoded together (the decode step's batch); more requests wait.
        prefill_chunk: prompt tokens a slot prefills per step.
        decode_steps: decode steps per call of the compiled step (the scheduler runs between calls).
        max_context: prompt + new tokens of one request; None: the model's max_len.
        prefix_sharing: share whole pages of a common prompt prefix between requests.
        seed: the sampling root of requests without a seed (folded with the request id).
        logprobs_mode: the log-probabilities returned: "penalized", under the logits each token is drawn
            from (penalties, biases, `min_tokens` and structured outputs applied; never the temperature),
            or "raw", under the model's own softmax (vLLM's default, `raw_logprobs`).
        speculative_tokens: tokens drafted per request by prompt lookup and checked in one step
            (`jaxformer.engine.speculate`; vLLM's `num_speculative_tokens` of its "ngram" method); 0: none.
        prompt_lookup_max: the longest n-gram of a request's last tokens looked up in its text.
        prompt_lookup_min: the shortest.
    """

    page_size: int = 16  # positions a page holds (vLLM's block size); a prefix is shared in whole pages
    num_pages: int = 256  # the pool, per layer, for keys and values; page 0 is a scratch page never handed out
    max_slots: int = 8  # sequences decoded together (the decode step's batch); more requests wait
    prefill_chunk: int = 32  # prompt tokens a slot prefills per step, so a long prompt never stalls decoding
    max_context: int | None = None  # prompt + new tokens of one request; None: the model's max_len
    # Decode steps per call of the compiled step (vLLM's multi-step scheduling): the scheduler runs between
    # calls, so more steps cost fewer returns to Python; a request that ends mid-call wastes the rest.
    decode_steps: int = 1
    prefix_sharing: bool = True  # requests sharing whole pages of prompt share those pages (copy-on-write)
    seed: int = 0  # root key of the sampling of requests that bring no seed (folded with the request id)
    # The log-probabilities returned: under the logits drawn from ("penalized": penalties, biases, min_tokens
    # and structured outputs applied, never the temperature) or under the model's own softmax ("raw", vLLM's).
    logprobs_mode: str = "penalized"
    # Speculative decoding by prompt lookup: a request's next tokens guessed from its own text (the tokens after
    # an earlier occurrence of its last n), all checked by one step; its tokens are those it gets without.
    speculative_tokens: int = 0  # drafted per request and step; 0: off
    prompt_lookup_max: int = 4  # the longest n-gram looked up
    prompt_lookup_min: int = 2  # the shortest

    def __post_init__(self):
        p = "engine"
        check_field_types(self, p)
        for name in ("page_size", "max_slots", "prefill_chunk", "decode_steps"):
            require(getattr(self, name) >= 1, f"{p}.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(self.speculative_tokens >= 0, f"{p}.speculative_tokens", f"must be >= 0, got {self.speculative_tokens}")
        require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            f"{p}.prompt_lookup_min",
            f"must be in [1, prompt_lookup_max={self.prompt_lookup_max}], got {self.prompt_lookup_min}",
        )
        modes = ("penalized", "raw")
        require(self.logprobs_mode in modes, f"{p}.logprobs_mode", f"one of {modes}, got {self.logprobs_mode!r}")
        require(self.num_pages >= 2, f"{p}.num_pages", f"must be >= 2 (page 0 is scratch), got {self.num_pages}")
        require(
            self.max_context is None or self.max_context >= 2,
            f"{p}.max_context",
            f"must be >= 2 (a prompt token and a new one) or None, got {self.max_context}",
        )
