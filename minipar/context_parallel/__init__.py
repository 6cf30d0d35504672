"""Context parallelism: the cp ranks split each sequence (`context`: wiring, splitting, the loss
weights), attention over the whole of it by a ring of key/value blocks or by all-to-all
(`ring_attention`); a Hugging Face model's attention routed through the same slot (`hf_attention`)."""
