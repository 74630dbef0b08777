"""Integrations with other libraries, one module each, imported on demand.

``import ac2_dist`` imports none of them (they import their library):

- :mod:`ac2_dist.integrations.hf` -- Hugging Face transformers (``pip install 'ac2-dist[hf]'``).
"""
