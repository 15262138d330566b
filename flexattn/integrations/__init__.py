"""Glue between flexattn and other libraries (each needs its own optional extra).

``flexattn.integrations.transformers`` -- Hugging Face transformers (``pip install 'flexattn[transformers]'``).
"""
