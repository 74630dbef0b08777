"""Integrations with other libraries, one module each, imported on demand.

``import ac2_dist`` imports none of them (they import their library):

- :mod:`ac2_dist.integrations.hf` -- Hugging Face transformers (``pip install 'ac2-dist[hf]'``).
- :mod:`ac2_dist.integrations.torch_checkpoint` -- torch's own checkpoint entry points run by
  ac2: the one switch for frameworks that call them (HF Trainer, Lightning, accelerate,
  torchtune, torchtitan); needs only torch.
"""
