"""AO-GPT: any-order GPT as a masked diffusion language model, in JAX/Flax."""
