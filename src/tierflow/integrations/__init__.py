"""Adapters for training loops tierflow's users do not write themselves.

Each submodule imports its framework when it is imported, never before:
``import tierflow`` does not load any of them.

* :mod:`tierflow.integrations.transformers`: ``TierflowCallback`` for Hugging Face's
  ``transformers.Trainer``.
"""
