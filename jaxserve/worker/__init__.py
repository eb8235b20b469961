"""The worker box: model runner, input batch, buckets and sampler (imports JAX)."""
