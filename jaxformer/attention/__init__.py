"""Attention as one concern: masks, the reference and fused kernels, the KV cache, the layer, the ring.

- `masks`: which keys each query sees, as structure (`Mask`: causal, lengths, segments, cache
  position, a sliding window) and as the dense boolean arrays the reference builds.
- `kernels`: the reference attention and the dispatch to fused kernels (XLA, cuDNN, splash).
- `cache`: writing new keys and values into a KV cache's slots.
- `ring_kernels`, `ring`: context parallelism: the kernel inside each block, and the ring and
  all-gather strategies over a sequence split on a mesh axis.
- `layer`: `MultiHeadAttention`, the NNX module that holds the projections and calls the above.
- `mla`, `mla_layer`: multi-head latent attention (`model.mla`, DeepSeek-V2/V3): its maths (the plain
  and the absorbed form over a latent cache) and `MultiHeadLatentAttention`, the module.

Everything but `layer` and `mla_layer` is plain `jax.numpy` (no Flax). `jaxformer.functional`, `jaxformer.layers`
and `jaxformer.ring` re-export the names they used to define. Nothing is imported here, so reading
the masks does not load the layer.
"""
