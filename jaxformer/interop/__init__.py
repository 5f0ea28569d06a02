"""Other frameworks' checkpoints in and out of jaxformer (see `jaxformer.interop.hf`)."""
