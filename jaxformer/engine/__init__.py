"""The inference engine: a paged KV cache, continuous batching and prefix sharing, for serving a
model (`jaxformer.serve` puts it behind HTTP) and for batch jobs from Python (`Engine.generate`).

- `paged`: the pure maths (pages gathered into a view, new keys and values written into pages, the
  model's step over pages, per-row sampling)
- `pages`: the page allocator (reference counts, the prefix cache of chained page hashes)
- `requests`: what a request is and gets back (SamplingParams, Event, Output, EngineError)
- `guided`: structured outputs (an output held to choices, a regular expression or a JSON schema)
- `adapters`: several LoRA adapters served side by side, stacked, each request choosing its own
- `speculate`: speculative decoding by prompt lookup (drafts from a request's own text, checked in one step)
- `engine`: the scheduler (Engine)
"""

from jaxformer.engine.engine import Engine
from jaxformer.engine.requests import EngineError, Event, Output, SamplingParams

__all__ = ["Engine", "EngineError", "Event", "Output", "SamplingParams"]
