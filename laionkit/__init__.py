"""laionkit: from LAION parquet metadata to a trained latent-diffusion model.

parquet -> filter -> pack (img2dataset) -> encode (VAE + text latents) -> train (Accelerate).
"""

__version__ = "0.1.0"
