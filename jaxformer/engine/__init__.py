"""The inference engine: a paged KV cache, continuous batching and prefix sharing, for serving a
model (`jaxformer.serve` puts it behind HTTP) and for batch jobs from Python (`Engine.generate`).

- `paged`: the pure maths (pages gathered into a view, new keys and values written into pages, the
  model's step over pages, per-row sampling)
- `pages`: the page allocator (reference counts, the prefix cache of chained page hashes)
- `engine`: the scheduler and its request types (Engine, SamplingParams, Event, Output, EngineError)
"""

from jaxformer.engine.engine import Engine, EngineError, Event, Output, SamplingParams

__all__ = ["Engine", "EngineError", "Event", "Output", "SamplingParams"]
