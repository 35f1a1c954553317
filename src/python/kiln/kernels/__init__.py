"""Attention kernels: the Pallas flash attention (`flash_attention`) and its jnp reference."""
