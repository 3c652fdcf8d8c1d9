"""pd-serve benchmarks: the serving load generator, offline throughput and KV transfer."""
